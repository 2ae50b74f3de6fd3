#!/usr/bin/env python3
"""Fetch the pinned llama.cpp tree (see llama.cpp.pin), verify it, unpack it, print its path.

The tree comes from the PyPI sdist of llama-cpp-python, which vendors the pinned upstream
commit. Only the standard library is used: the sdist URL is read from the registry's simple
index (PEP 691/503, the same index pip uses, honouring PIP_INDEX_URL). No Python package is
ever installed. Without network it says where to put the sdist by hand (or LLAMA_CPP_DIR).

Every tarball, downloaded or given with --tarball, is checked against the pinned sha256
before anything is unpacked; a mismatch is refused (a download short of its announced size is
reported as truncated). A cached sdist that fails the check is moved aside to NAME.bad and
downloaded again. Unpacking goes to a temporary folder that is renamed into place, so an
interrupted fetch never leaves a half tree behind.

Usage: fetch.py [--cache DIR] [--tarball FILE] [--quiet]
"""
import argparse
import hashlib
import html.parser
import http.client
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def read_pin(path=os.path.join(HERE, "llama.cpp.pin")):
    pin = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                pin[key.strip()] = value.strip()
    for key in ("commit", "package", "version", "sdist", "sha256", "subdir"):
        if key not in pin:
            sys.exit(f"fetch: {path}: missing key '{key}'")
    return pin


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


class NetworkError(Exception):
    """The index or the file could not be read from the network: `url` and why."""

    def __init__(self, url, why):
        super().__init__(f"{url}: {why}")
        self.url, self.why = url, why


def _open(url, timeout):
    req = urllib.request.Request(url, headers={
        # PEP 691 JSON (it gives the file's size, PEP 700) where the index has it, else PEP 503 HTML
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError and timeouts are OSErrors
        raise NetworkError(url, getattr(e, "reason", None) or e) from None


def _read(r, url, n=-1):
    try:
        return r.read(n)
    except (OSError, http.client.HTTPException) as e:
        raise NetworkError(url, e) from None


def find_sdist(pin, log):
    """(url, size or None) of the pinned sdist on the index (PIP_INDEX_URL, default PyPI)."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = f"{index}/{pin['package']}/"
    log(f"fetch: reading {page}")
    with _open(page, 60) as r:
        kind = r.headers.get("Content-Type", "")
        body = _read(r, page).decode("utf-8", "replace")
    if "json" in kind:
        try:
            files = json.loads(body).get("files", [])
        except ValueError as e:
            raise NetworkError(page, f"not a valid index page ({e})") from None
        entries = [(f.get("url", ""), f.get("size")) for f in files if f.get("filename") == pin["sdist"]]
    else:
        parser = _Links()
        parser.feed(body)
        entries = [(h, None) for h in parser.hrefs]
    for href, size in entries:
        url = urllib.parse.urljoin(page, href)
        if urllib.parse.urlparse(url).path.rsplit("/", 1)[-1] == pin["sdist"]:
            return url.split("#")[0], size if isinstance(size, int) else None
    raise NetworkError(page, f"{pin['sdist']} is not listed there")


def download(pin, dest, log):
    """Downloads the sdist to dest (through dest.part). Returns (url, bytes received, bytes
    expected or None). Network trouble raises NetworkError; a local write error raises OSError."""
    url, size = find_sdist(pin, log)
    log(f"fetch: downloading {url}")
    tmp = dest + ".part"
    try:
        with _open(url, 600) as r, open(tmp, "wb") as out:
            length = r.headers.get("Content-Length")
            expected = int(length) if length and length.isdigit() else size
            got = 0
            while True:
                block = _read(r, url, 1 << 20)
                if not block:
                    break
                out.write(block)
                got += len(block)
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return url, got, expected


def offline_help(pin, tarball, e):
    return (f"fetch: could not download the pinned llama.cpp sdist: {e.url}: {e.why}\n"
            f"  Without network, put the sdist into the cache by hand (it is checked before use):\n"
            f"    {tarball}\n"
            f"    sha256 {pin['sha256']}\n"
            f"  (from https://pypi.org/project/{pin['package']}/{pin['version']}/#files on a machine with "
            f"network), or set LLAMA_CPP_DIR to a llama.cpp checkout at commit {pin['commit']}.")


def unpack(tarball, pin, tree, log):
    log(f"fetch: unpacking {pin['subdir']} into {tree}")
    parent = os.path.dirname(tree)
    tmp = tempfile.mkdtemp(prefix=".unpack-", dir=parent)
    try:
        prefix = pin["subdir"].rstrip("/") + "/"
        with tarfile.open(tarball, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise RuntimeError(f"{tarball} has no folder {pin['subdir']}")
            tar.extractall(tmp, members=members, filter="tar") if hasattr(tarfile, "data_filter") \
                else tar.extractall(tmp, members=members)
        with open(os.path.join(tmp, pin["subdir"], ".reap-pin"), "w") as f:
            f.write(pin["sha256"] + "\n")
        if os.path.exists(tree):
            shutil.rmtree(tree)
        os.replace(os.path.join(tmp, pin["subdir"]), tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    try:
        return fetch()
    except OSError as e:  # network errors are NetworkError by now: this is the local disk
        where = f" ({e.filename})" if e.filename else ""
        sys.exit(f"fetch: local I/O error{where}: {e.strerror or e}. The sdist and its unpacked tree live in the "
                 f"cache (REAP_IMATRIX_CACHE moves it); it must be writable until the tree is unpacked.")


def fetch():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default=os.environ.get("REAP_IMATRIX_CACHE", os.path.join(HERE, "cache")))
    ap.add_argument("--tarball", help="use this sdist instead of downloading (still verified)")
    ap.add_argument("--pin", default=os.path.join(HERE, "llama.cpp.pin"))
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    log = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))

    pin = read_pin(args.pin)
    cache = os.path.abspath(args.cache)
    os.makedirs(cache, exist_ok=True)
    tree = os.path.join(cache, f"llama.cpp-{pin['commit']}")
    stamp = os.path.join(tree, ".reap-pin")
    if not args.tarball and os.path.isfile(stamp) and open(stamp).read().strip() == pin["sha256"]:
        print(tree)
        return 0

    if not os.access(cache, os.W_OK):
        sys.exit(f"fetch: the cache {cache} is not writable, and the pinned tree is not unpacked there yet "
                 f"({tree}): make it writable, or set REAP_IMATRIX_CACHE to a writable folder.")
    tarball = os.path.abspath(args.tarball) if args.tarball else os.path.join(cache, pin["sdist"])
    if args.tarball:
        if not os.path.isfile(tarball):
            sys.exit(f"fetch: {tarball}: no such file")
        got = sha256_of(tarball)
        if got != pin["sha256"]:
            sys.exit(f"fetch: sha256 mismatch for {tarball}: expected {pin['sha256']} (pin {args.pin}), "
                     f"got {got}; refusing to use it")
    else:
        if os.path.isfile(tarball):
            got = sha256_of(tarball)
            if got != pin["sha256"]:
                # a damaged cached copy: kept aside for a look, never used, fetched again
                bad = tarball + ".bad"
                os.replace(tarball, bad)
                print(f"fetch: the cached {tarball} does not match the pin (sha256 {got}, "
                      f"{os.path.getsize(bad)} bytes); moved it to {bad}, downloading again", file=sys.stderr)
        if not os.path.isfile(tarball):
            try:
                url, size, expected = download(pin, tarball, log)
            except NetworkError as e:
                sys.exit(offline_help(pin, tarball, e))
            if expected is not None and size != expected:
                os.remove(tarball)
                sys.exit(f"fetch: truncated download ({size} of {expected} bytes) of {pin['sdist']} from {url}; "
                         f"removed it, try again")
            got = sha256_of(tarball)
            if got != pin["sha256"]:
                os.remove(tarball)
                sys.exit(f"fetch: sha256 mismatch for the downloaded {pin['sdist']} ({size} bytes): expected "
                         f"{pin['sha256']} (pin {args.pin}), got {got}; removed it, refusing to use it")
    unpack(tarball, pin, tree, log)
    print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
