"""A stand-in for PyTorch, just enough for scripts/to-reap-pt, so its output can be tested on
machines without torch. Tensors are flat lists with a shape; `save` writes JSON that says what
a real torch.save would have stored (key types, dtypes, shapes, values)."""

import json
import struct


class dtype:
    def __init__(self, name):
        self.name = name

    def cast(self, x):
        if self.name in ("int64", "bool"):
            return int(x) if self.name == "int64" else bool(x)
        x = float(x)
        return struct.unpack("f", struct.pack("f", x))[0] if self.name == "float32" else x


int64, float64, float32, bool_ = dtype("int64"), dtype("float64"), dtype("float32"), dtype("bool")


def _flatten(v):
    if isinstance(v, list):
        if not v:
            return [], (0,)
        parts = [_flatten(x) for x in v]
        return [y for p, _ in parts for y in p], (len(v),) + parts[0][1]
    return [v], ()


class Tensor:
    def __init__(self, data, shape, dt):
        self.data, self.shape, self.dtype = [dt.cast(x) for x in data], tuple(shape), dt

    def to(self, dt):
        return Tensor(self.data, self.shape, dt)

    def unsqueeze(self, dim):
        s = list(self.shape)
        s.insert(dim, 1)
        return Tensor(self.data, s, self.dtype)

    def clamp(self, min):
        return Tensor([max(x, min) for x in self.data], self.shape, self.dtype)

    def _binary(self, other, op, out_dtype=None):
        if not isinstance(other, Tensor):
            other = Tensor([other], (), self.dtype)
        n = max(len(self.shape), len(other.shape))
        a = (1,) * (n - len(self.shape)) + self.shape
        b = (1,) * (n - len(other.shape)) + other.shape
        shape = tuple(max(x, y) for x, y in zip(a, b))
        assert all(x in (1, s) and y in (1, s) for x, y, s in zip(a, b, shape)), "shapes do not broadcast"

        def at(t, dims, idx):
            flat = 0
            for d, i in zip(dims, idx):
                flat = flat * d + (0 if d == 1 else i)
            return t.data[flat]

        out = []
        total = 1
        for s in shape:
            total *= s
        for k in range(total):
            idx, r = [], k
            for s in reversed(shape):
                idx.insert(0, r % s)
                r //= s
            out.append(op(at(self, a, idx), at(other, b, idx)))
        return Tensor(out, shape, out_dtype or self.dtype)

    def __add__(self, o):
        return self._binary(o, lambda x, y: x + y)

    def __truediv__(self, o):
        return self._binary(o, lambda x, y: x / y)

    def __gt__(self, o):
        return self._binary(o, lambda x, y: x > y, bool_)


def tensor(v, dtype):
    data, shape = _flatten(v)
    return Tensor(data, shape, dtype)


def zeros_like(t):
    return Tensor([0] * len(t.data), t.shape, t.dtype)


def where(cond, a, b):
    return Tensor([x if c else y for c, x, y in zip(cond.data, a.data, b.data)], a.shape, a.dtype)


def _describe(v):
    if isinstance(v, Tensor):
        return {"tensor": {"dtype": v.dtype.name, "shape": list(v.shape), "data": v.data}}
    if isinstance(v, dict):
        return {"dict": [[type(k).__name__, k, _describe(x)] for k, x in v.items()]}
    raise TypeError(f"fake torch.save: cannot describe {type(v)}")


def save(obj, f):
    f.write(json.dumps(_describe(obj)).encode())
