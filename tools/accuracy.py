"""The accuracy report: attention error of each INT8 scale mode against unquantized fp16
attention, on Gaussian K/V and on K with outlier channels (lowlevel_fd/accuracy.py).

    PYTHONPATH=. python3 tools/accuracy.py                  # CPU (numpy, deterministic)
    PYTHONPATH=. python3 tools/accuracy.py --gpu            # also through the kernels: prompt
                                                            # quantization + one appended
                                                            # token + DecodePlan
    PYTHONPATH=. python3 tools/accuracy.py --update-readme  # also write it into README.md

README.md holds the table between ``<!-- ACCURACY -->`` and ``<!-- /ACCURACY -->``; a lone
``<!-- ACCURACY ... -->`` placeholder is replaced by the table wrapped in both markers.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

import numpy as np

from lowlevel_fd.accuracy import (DATA_KINDS, SCALE_MODES, Data, ErrorRow, Shape, errors,
                                  make_data, markdown_table, measure, reference_output)

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- ACCURACY -->", "<!-- /ACCURACY -->"
_PAIRED = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
_PLACEHOLDER = re.compile(r"<!--\s*ACCURACY\b.*?-->", re.DOTALL)


def splice(text: str, table: str) -> str:
    """``text`` with the accuracy block replaced by ``table`` (see the module docstring)."""
    block = f"{BEGIN}\n{table}\n{END}"
    if _PAIRED.search(text):
        return _PAIRED.sub(lambda _: block, text, count=1)
    if END in text:
        raise ValueError(f"README: found {END} without a {BEGIN} before it")
    matches = _PLACEHOLDER.findall(text)
    if len(matches) != 1:
        raise ValueError(f"README: expected one {BEGIN} placeholder (or the pair "
                         f"{BEGIN} ... {END}), found {len(matches)}")
    return _PLACEHOLDER.sub(lambda _: block, text, count=1)


# -- the same measurement through the GPU kernels ----------------------------------------------
def gpu_output(data: Data, mode: str, device, stream) -> np.ndarray:
    """Quantize tokens 0..S-2 with PromptQuantizer, append token S-1 with AppendPlan (advance),
    attend with DecodePlan; returns the fp16 output as float64 ``[B, Hq, D]``."""
    from lowlevel_fd import AppendPlan, DecodePlan, DeviceArray, KVCacheSpec, PromptQuantizer
    from lowlevel_fd.accuracy import key_transform, transformed_query
    from lowlevel_fd.quant import calibrate_scales

    scale_mode, scale_dtype = SCALE_MODES[mode]
    B, Hkv, S, D = data.k.shape
    Hq = data.q.shape[1]
    owned: list = []

    def upload(host: np.ndarray) -> DeviceArray:
        owned.append(DeviceArray.from_numpy(np.ascontiguousarray(host), device))
        return owned[-1]

    def empty(shape, dtype) -> DeviceArray:
        owned.append(DeviceArray.empty(shape, dtype, device))
        return owned[-1]

    cache = KVCacheSpec(Hkv, D, kv_layout="bnsh", scale_mode=scale_mode,
                        scale_dtype=scale_dtype, key_transform=key_transform(mode))
    try:
        k, v = upload(data.k), upload(data.v)
        q = upload(data.q if key_transform(mode) == "none" else transformed_query(data.q))
        caches = [empty((B, Hkv, S, D), np.int8) for _ in range(2)]
        if scale_mode == "token":
            scales = [empty((B, Hkv, S), np.dtype(scale_dtype)) for _ in range(2)]
        else:  # calibrated on the whole cache, as the CPU rows are
            scales = [upload(calibrate_scales(x, scale_mode)) for x in (data.k, data.v)]
        seq_lens = upload(np.full(B, S - 1, np.int32))
        out = empty((B, Hq, D), np.float16)
        with PromptQuantizer(cache, max_batch=B, prompt_layout="bnsh",
                             device=device) as prompt, \
                AppendPlan(cache, Hq, max_batch=B, device=device) as append, \
                DecodePlan(cache, Hq, max_batch=B, max_seq_len=S, device=device) as attention:
            prompt.run(k, v, *caches, *scales, seq_lens, stream=stream)
            append.run(k[:, :, S - 1], v[:, :, S - 1], *caches, *scales, seq_lens,
                       advance=True, stream=stream)
            attention.plan([S] * B)
            attention.run(q, *caches, *scales, seq_lens, out, stream=stream)
            if (prompt.error_flags(stream=stream) or append.error_flags(stream=stream)
                    or attention.error_flags(stream=stream)):
                raise RuntimeError("accuracy --gpu: a kernel reported an error flag")
            result = out.numpy(stream=stream).astype(np.float64)
            if seq_lens.numpy().tolist() != [S] * B:
                raise RuntimeError("accuracy --gpu: the append did not advance the lengths")
        return result
    finally:
        stream.synchronize()
        for array in owned:
            array.close()


def measure_gpu(shape: Shape, seed: int) -> list[ErrorRow]:
    from lowlevel_fd.driver import Device, Stream

    device = Device(0)
    rows = []
    with Stream(device) as stream:
        for kind in DATA_KINDS:
            data = make_data(kind, shape, seed)
            ref = reference_output(data)
            rows.extend(errors(gpu_output(data, mode, device, stream), ref, data=kind,
                               mode=mode, path="gpu") for mode in SCALE_MODES)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu", action="store_true",
                        help="also run prompt quantization + append + DecodePlan on the GPU")
    parser.add_argument("--update-readme", action="store_true",
                        help="write the table into README.md between the ACCURACY markers")
    parser.add_argument("--readme", type=Path, default=README, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    shape = Shape()
    rows = measure(shape, seed=args.seed)
    if args.gpu:
        rows += measure_gpu(shape, args.seed)
    command = shlex.join(["python3", "tools/accuracy.py", *(argv if argv is not None
                                                              else sys.argv[1:])])
    paths = ("cpu rows: numpy, deterministic" + ("; gpu rows: prompt quantization, one "
             "appended token and DecodePlan on the GPU" if args.gpu else ""))
    table = (markdown_table(rows, shape) + f"\n\nProduced by `{command}` (seed {args.seed}; "
             f"{paths}). The max column is a single element's error and varies with the seed; "
             f"the mean and L2 columns are the stable comparison between modes.")
    print(table)
    if args.update_readme:
        args.readme.write_text(splice(args.readme.read_text(), table))
        print(f"\nwrote the table into {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
