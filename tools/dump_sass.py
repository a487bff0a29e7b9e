"""Write the CUBIN of one decode variant, for cuobjdump -sass / nvdisasm on a machine that has
them. Usage: dump_sass.py OUT.cubin [head_dim group q_dtype scale_mode scale_dtype warps stages]
(default: the reference workload's variant), compiled for sm_90."""
from __future__ import annotations

import sys

from lowlevel_fd.decode.variants import DecodeVariant


def main() -> None:
    args = sys.argv[2:] or ["128", "4", "float16", "token", "float32", "8", "2"]
    variant = DecodeVariant(int(args[0]), int(args[1]), args[2], args[3], args[4], int(args[5]),
                            int(args[6]))
    program = variant.compile("sm_90")
    with open(sys.argv[1], "wb") as handle:
        handle.write(program.cubin)
    print(program.symbol(variant.split_kernel))


if __name__ == "__main__":
    main()
