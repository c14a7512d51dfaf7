"""A step of engines/q4step.c as data (numpy only): a random model and inputs, their file form, the float result.

engines/q4harness.c reads a case's file, runs the library on it and writes
what it made; `reference` computes the same step in float64 numpy from the
dequantized 4-bit weights (the float model of the very weights the C step
reads: tests/test_q4step.py holds it to torch's LlamaModel), and `compare`
says how far apart the two are. engines/q4check.py runs the checks a build
must pass; tests run them under AddressSanitizer and, cross-compiled for
aarch64, under qemu-user, where no torch can be loaded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engines import q4layout

MAGIC = b"Q4C1"
# The four products of a layer, in the C struct's order: (name, output rows, input width) in units of (hidden, inter).
PRODUCTS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class Product:
    """One 4-bit product as the C step reads it: words (rows x cols/4, int16), scales and zeros (bfloat16 bits)."""

    words: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        """(output rows, input width)."""
        return self.words.shape[0], self.words.shape[1] * 4

    def weights(self) -> np.ndarray:
        return q4layout.dequantize(self.words, self.scales, self.zeros)


@dataclass(frozen=True)
class Layer:
    input_norm: np.ndarray
    post_norm: np.ndarray
    products: tuple[Product, Product, Product, Product]  # PRODUCTS' order


@dataclass(frozen=True)
class Case:
    """A model, one step's inputs and the cache it extends: what q4_step takes (q4step.c states the shapes)."""

    hidden: int
    heads: int
    head_dim: int
    inter: int
    eps: float
    scaling: float
    inv_freq: np.ndarray  # float32, head_dim / 2
    norm: np.ndarray
    layers: tuple[Layer, ...]
    x: np.ndarray  # float32, rows x hidden
    positions: np.ndarray  # int64, rows
    mask: np.ndarray | None  # bool, rows x (width + 1)
    keys: tuple[np.ndarray, ...]  # float32, per layer rows x heads x room x head_dim
    values: tuple[np.ndarray, ...]
    width: int
    threads: int = 1

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])

    def row(self, r: int, threads: int = 1) -> Case:
        """Row `r` alone: its input, position and cache, attending to its unmasked columns, without a mask when
        it sees every column."""
        mask = None if self.mask is None or self.mask[r].all() else self.mask[r : r + 1]
        return replace(
            self,
            x=self.x[r : r + 1],
            positions=self.positions[r : r + 1],
            mask=mask,
            keys=tuple(k[r : r + 1].copy() for k in self.keys),
            values=tuple(v[r : r + 1].copy() for v in self.values),
            threads=threads,
        )


@dataclass
class Result:
    """What the library made of a case: q4_step's code, its outputs and the caches after it, and q4_product's code
    and output on layer 0's qkv product with the case's inputs."""

    code: int
    out: np.ndarray
    keys: list[np.ndarray]
    values: list[np.ndarray]
    product_code: int
    product: np.ndarray


def _product(rng: np.random.Generator, rows: int, cols: int) -> Product:
    q = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    groups = cols // q4layout.GROUP
    scales = q4layout.to_bfloat16(rng.uniform(0.5, 1.5, size=(rows, groups)).astype(np.float32) / (4 * np.sqrt(cols)))
    zeros = q4layout.to_bfloat16(rng.normal(0, 0.2, size=(rows, groups)).astype(np.float32) / np.sqrt(cols))
    # Widths the words cannot hold (q4step.c must refuse them) keep their q in words all the same.
    padded = -(-cols // q4layout.BLOCK) * q4layout.BLOCK
    words = q4layout.pack(np.pad(q, ((0, 0), (0, padded - cols))))[:, : cols // 4]
    return Product(np.ascontiguousarray(words), scales, zeros)


def random_case(
    seed: int, hidden: int = 256, heads: int = 4, inter: int = 320, layers: int = 2, lengths: tuple[int, ...] = (9,)
) -> Case:
    """A random model and one step of rows whose real cached lengths are `lengths`, right-aligned (left padding) as
    the decode loop pads them, the widest first; columns past the cache hold NaN (never read), padded ones large
    values (never weighed)."""
    rng = np.random.default_rng(seed)
    head_dim, rows, width = hidden // heads, len(lengths), max(lengths)
    room = width + 3
    made = []
    for _ in range(layers):
        norms = [rng.uniform(0.8, 1.2, size=hidden).astype(np.float32) for _ in range(2)]
        shapes = ((3 * hidden, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter))
        made.append(Layer(norms[0], norms[1], tuple(_product(rng, r, c) for r, c in shapes)))  # type: ignore[arg-type]
    seen = np.arange(width + 1)[None, :] >= (width - np.asarray(lengths))[:, None]
    caches = []
    for _ in range(2 * layers):
        cache = np.full((rows, heads, room, head_dim), np.nan, dtype=np.float32)
        cache[:, :, :width] = rng.normal(0, 1, size=(rows, heads, width, head_dim))
        cache[:, :, :width][~np.broadcast_to(seen[:, None, :width, None], cache[:, :, :width].shape)] = 1e4
        caches.append(cache)
    return Case(
        hidden=hidden,
        heads=heads,
        head_dim=head_dim,
        inter=inter,
        eps=1e-6,
        scaling=head_dim**-0.5,
        inv_freq=(1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32),
        norm=rng.uniform(0.8, 1.2, size=hidden).astype(np.float32),
        layers=tuple(made),
        x=rng.normal(0, 1, size=(rows, hidden)).astype(np.float32),
        positions=np.asarray(lengths, dtype=np.int64),
        mask=None if seen.all() else seen,
        keys=tuple(caches[:layers]),
        values=tuple(caches[layers:]),
        width=width,
        threads=2,
    )


def write(case: Case, path: Path) -> None:
    """`case` as engines/q4harness.c reads it (native byte order)."""
    dims = (len(case.layers), case.hidden, case.heads, case.head_dim, case.inter, case.rows, case.width)
    with path.open("wb") as out:
        out.write(MAGIC + struct.pack("=9i2f", *dims, case.threads, case.mask is not None, case.eps, case.scaling))
        for array in (case.inv_freq, case.norm):
            out.write(np.ascontiguousarray(array, dtype=np.float32).tobytes())
        for layer in case.layers:
            out.write(layer.input_norm.astype(np.float32).tobytes() + layer.post_norm.astype(np.float32).tobytes())
            for p in layer.products:
                out.write(struct.pack("=2i", *p.shape))
                out.write(
                    p.words.tobytes() + p.scales.astype(np.uint16).tobytes() + p.zeros.astype(np.uint16).tobytes()
                )
        out.write(case.x.astype(np.float32).tobytes() + case.positions.astype(np.int64).tobytes())
        if case.mask is not None:
            out.write(case.mask.astype(np.uint8).tobytes())
        out.write(np.asarray([k.shape[2] for k in case.keys], dtype=np.int32).tobytes())
        for keys, values in zip(case.keys, case.values):
            out.write(keys.astype(np.float32).tobytes() + values.astype(np.float32).tobytes())


def read(case: Case, path: Path) -> Result:
    """What engines/q4harness.c wrote for `case` at `path`. Raises ValueError when it is not that long."""
    data = path.read_bytes()
    floats = np.frombuffer(data, dtype=np.float32, offset=8)
    rows, d = case.rows, case.hidden
    sizes = [rows * d, rows * 3 * d] + [k.size for k in case.keys for _ in range(2)]
    if len(data) != 8 + 4 * sum(sizes):
        raise ValueError(f"{path}: {len(data)} bytes, not a result of this case")
    code, product_code = struct.unpack("=2i", data[:8])
    parts, at = [], 0
    for size in sizes:
        parts.append(floats[at : at + size])
        at += size
    caches = [parts[2 + i].reshape(k.shape) for i, k in enumerate(k for k in case.keys for _ in range(2))]
    return Result(code, parts[0].reshape(rows, d), caches[0::2], caches[1::2], product_code, parts[1].reshape(rows, -1))


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def reference(case: Case) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], np.ndarray]:
    """The float64 step of `case` on its dequantized weights, as transformers' LlamaModel runs it: the final
    hidden states (rows x hidden), each layer's new key and value column (rows x heads x head_dim), and layer 0's
    qkv product of the inputs."""
    rows, heads, dim, width = case.rows, case.heads, case.head_dim, case.width
    # The angle in float32, as torch's rotary embedding makes it.
    angle = (case.positions.astype(np.float32)[:, None] * case.inv_freq[None, :]).astype(np.float64)
    cos, sin = np.cos(np.concatenate([angle, angle], -1))[:, None], np.sin(np.concatenate([angle, angle], -1))[:, None]
    seen = np.ones((rows, width + 1), dtype=bool) if case.mask is None else case.mask
    x = case.x.astype(np.float64)
    new_keys, new_values = [], []
    weights = [[p.weights().astype(np.float64) for p in layer.products] for layer in case.layers]
    for layer, (qkv_w, o_w, gate_up_w, down_w), keys, values in zip(case.layers, weights, case.keys, case.values):
        qkv = _rms(x, layer.input_norm, case.eps) @ qkv_w.T
        q, k, v = (qkv[:, i * case.hidden : (i + 1) * case.hidden].reshape(rows, heads, dim) for i in range(3))
        q, k = (t * cos + np.concatenate([-t[..., dim // 2 :], t[..., : dim // 2]], -1) * sin for t in (q, k))
        new_keys.append(k)
        new_values.append(v)
        all_k = np.concatenate([keys[:, :, :width].astype(np.float64), k[:, :, None]], 2)
        all_v = np.concatenate([values[:, :, :width].astype(np.float64), v[:, :, None]], 2)
        scores = np.einsum("rhd,rhtd->rht", q, all_k) * case.scaling
        scores = np.where(seen[:, None, :], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        attended = np.einsum("rht,rhtd->rhd", p / p.sum(-1, keepdims=True), np.where(seen[:, None, :, None], all_v, 0))
        x = x + attended.reshape(rows, -1) @ o_w.T
        both = _rms(x, layer.post_norm, case.eps) @ gate_up_w.T
        gate, up = both[:, : case.inter], both[:, case.inter :]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ down_w.T
    return _rms(x, case.norm, case.eps), new_keys, new_values, product_reference(case)


def product_reference(case: Case) -> np.ndarray:
    """The float64 product of layer 0's qkv weights with the case's inputs (rows x 3 hidden)."""
    return case.x.astype(np.float64) @ case.layers[0].products[0].weights().astype(np.float64).T


def relative(a: np.ndarray, b: np.ndarray) -> float:
    """|a - b| / |b| (Frobenius norms); inf where a holds a NaN."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b)) if np.isfinite(a).all() else float("inf")


def compare(case: Case, result: Result) -> dict[str, float]:
    """How far `result` is from `reference(case)`: the largest relative error of the hidden states, of the new
    key and value columns, and of q4_product's output; the cache's other columns must be untouched (inf if not)."""
    out, new_keys, new_values, product = reference(case)
    width = case.width
    cache = max(
        relative(mine[:, :, width], want)
        for got, wants in ((result.keys, new_keys), (result.values, new_values))
        for mine, want in zip(got, wants)
    )
    kept = all(
        np.array_equal(mine[:, :, c], given[:, :, c], equal_nan=True)
        for got, givens in ((result.keys, case.keys), (result.values, case.values))
        for mine, given in zip(got, givens)
        for c in range(given.shape[2])
        if c != width
    )
    kept_cache = cache if kept else float("inf")
    return {"hidden": relative(result.out, out), "cache": kept_cache, "product": relative(result.product, product)}
