"""Write the CUBIN of one decode variant, for cuobjdump -sass / nvdisasm on a machine that has
them; prints the kernel's symbol and its ptxas resources. No GPU needed (NVRTC only).

    PYTHONPATH=. python3 tools/dump_sass.py OUT.cubin [head_dim group dtype scale_mode
                                                       scale_dtype warps stages]
                                                      [--cluster] [--tiles 2] [--append]

Without the variant's values: the reference workload's (128 4 float16 token float32, the
planner's warp count, 2 stages)."""
from __future__ import annotations

import argparse

from lowlevel_fd.decode.planner import DEFAULT_WARPS
from lowlevel_fd.decode.variants import DecodeVariant

FIELDS = ("head_dim", "group", "dtype", "scale_mode", "scale_dtype", "warps", "stages")
DEFAULT = ("128", "4", "float16", "token", "float32", str(DEFAULT_WARPS), "2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="where to write the CUBIN")
    parser.add_argument("variant", nargs="*", metavar="VALUE",
                        help=f"{' '.join(FIELDS)} (default: {' '.join(DEFAULT)})")
    parser.add_argument("--arch", default="sm_90", help="target (default sm_90)")
    parser.add_argument("--cluster", action="store_true",
                        help="the splits merge in a thread-block cluster (sm_90)")
    parser.add_argument("--tiles", type=int, choices=(1, 2), default=1,
                        help="16-token tiles per warp step")
    parser.add_argument("--append", action="store_true",
                        help="the fused-append instantiation (DecodePlan.append_and_run)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    values = args.variant or list(DEFAULT)
    if len(values) != len(FIELDS):
        parser.error(f"expected the {len(FIELDS)} values {' '.join(FIELDS)}, got {values}")
    head_dim, group, dtype, scale_mode, scale_dtype, warps, stages = values
    variant = DecodeVariant(int(head_dim), int(group), dtype=dtype, scale_mode=scale_mode,
                            scale_dtype=scale_dtype, num_warps=int(warps), stages=int(stages),
                            cluster=args.cluster, tiles=args.tiles, append=args.append)
    program = variant.compile(args.arch)
    with open(args.out, "wb") as handle:
        handle.write(program.cubin)
    symbol = program.symbol(variant.split_kernel)
    print(symbol)
    print(program.resources.get(symbol, "(no ptxas report for it)"))


if __name__ == "__main__":
    main()
