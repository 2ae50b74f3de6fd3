#!/usr/bin/env python3
"""Fetch the pinned llama.cpp tree (see llama.cpp.pin), verify it, unpack it, print its path.

The tree comes from the PyPI sdist of llama-cpp-python, which vendors the pinned upstream
commit. Only the standard library is used: the sdist URL is read from the registry's simple
index (PEP 503, the same index pip uses, honouring PIP_INDEX_URL), so neither cmake nor
scikit-build-core is needed just to download. `pip download` is the fallback.

Every tarball, downloaded or given with --tarball, is checked against the pinned sha256
before anything is unpacked; a mismatch is refused. Unpacking goes to a temporary folder
that is renamed into place, so an interrupted fetch never leaves a half tree behind.

Usage: fetch.py [--cache DIR] [--tarball FILE] [--quiet]
"""
import argparse
import hashlib
import html.parser
import os
import shutil
import subprocess
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


def download_from_index(pin, dest, log):
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = f"{index}/{pin['package']}/"
    log(f"fetch: reading {page}")
    with urllib.request.urlopen(page, timeout=60) as r:
        parser = _Links()
        parser.feed(r.read().decode("utf-8", "replace"))
    for href in parser.hrefs:
        url = urllib.parse.urljoin(page, href)
        if urllib.parse.urlparse(url).path.rsplit("/", 1)[-1] == pin["sdist"]:
            log(f"fetch: downloading {url.split('#')[0]}")
            tmp = dest + ".part"
            with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as out:
                shutil.copyfileobj(r, out, 1 << 20)
            os.replace(tmp, dest)
            return
    raise RuntimeError(f"{pin['sdist']} is not listed on {page}")


def download_with_pip(pin, cache, log):
    log("fetch: falling back to `pip download` (needs cmake and scikit-build-core)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cmake", "scikit-build-core"], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--no-build-isolation", f"{pin['package']}=={pin['version']}", "-d", cache],
        check=True,
    )


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

    tarball = os.path.abspath(args.tarball) if args.tarball else os.path.join(cache, pin["sdist"])
    downloaded = False
    if not os.path.isfile(tarball):
        if args.tarball:
            sys.exit(f"fetch: {tarball}: no such file")
        try:
            download_from_index(pin, tarball, log)
        except Exception as e:  # network or index trouble: let pip try its own way
            log(f"fetch: index download failed ({e})")
            download_with_pip(pin, cache, log)
        downloaded = True

    got = sha256_of(tarball)
    if got != pin["sha256"]:
        if downloaded:
            os.remove(tarball)
        sys.exit(f"fetch: sha256 mismatch for {tarball}: expected {pin['sha256']} (pin {args.pin}), "
                 f"got {got}; refusing to use it")
    unpack(tarball, pin, tree, log)
    print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
