"""torch's int8 CPU products side by side: today's dynamic quantization (torch.ao) against aten's weight-only kernel.

    bench/int8_kernels.py [--threads 2] [--rounds 15] [--rows 1,4,100]

TTS_QUANTIZE=int8 runs the GPT's linear layers through
`torch.ao.quantization.quantize_dynamic` (per-channel int8 weights,
activations quantized per call), which PyTorch has deprecated. The one
maintained int8 path in torch itself is `aten._weight_int8pack_mm`
(per-channel int8 weights, float32 or bfloat16 activations). On ChatTTS's
80 products of a step (random weights of its shapes, each layer's own), at
each row count: the best of `--rounds` passes of each, interleaved, in ms
and as a ratio to torch.ao's.
"""

from __future__ import annotations

import argparse
import time
import warnings

# The GPT's products, (out, in), per layer: fused Q/K/V, output, fused gate/up, down.
SHAPES = ((2304, 768), (768, 768), (6144, 768), (768, 3072))
LAYERS = 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", default="1,4,100")
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    qconfig = {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
    dynamic, weight_only = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(LAYERS):
            for rows, cols in SHAPES:
                linear = torch.nn.Linear(cols, rows, bias=False)
                dynamic.append(torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), qconfig))
                w = linear.weight.detach()
                scale = w.abs().amax(1) / 127
                q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
                weight_only.append((q, {dtype: scale.to(dtype) for dtype in (torch.float32, torch.bfloat16)}))
    print(f"{LAYERS * len(SHAPES)} products a step, {args.threads} thread(s), best of {args.rounds}, interleaved")
    with torch.inference_mode():
        for count in [int(n) for n in args.rows.split(",")]:
            inputs = {cols: torch.randn(count, cols) for cols in (768, 3072)}
            best = {"torch.ao dynamic": float("inf"), "aten float32": float("inf"), "aten bfloat16": float("inf")}
            for _ in range(args.rounds):
                started = time.perf_counter()
                for module in dynamic:
                    module(inputs[module[0].in_features])
                best["torch.ao dynamic"] = min(best["torch.ao dynamic"], time.perf_counter() - started)
                for name, dtype in (("aten float32", torch.float32), ("aten bfloat16", torch.bfloat16)):
                    started = time.perf_counter()
                    for q, scales in weight_only:
                        # A layer casts its float32 input as a bfloat16 one would.
                        torch.ops.aten._weight_int8pack_mm(inputs[q.shape[1]].to(dtype), q, scales[dtype])
                    best[name] = min(best[name], time.perf_counter() - started)
            base = best["torch.ao dynamic"]
            print(f"{count} row(s): " + ", ".join(f"{k} {v * 1e3:.1f} ms ({v / base:.2f}x)" for k, v in best.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
