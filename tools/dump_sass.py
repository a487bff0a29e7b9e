"""Write the CUBIN of one decode variant (for cuobjdump/nvdisasm). Usage: dump_sass.py OUT.cubin
[head_dim group q_dtype scale_mode scale_dtype warps stages]"""
from __future__ import annotations

import sys

from lowlevel_fd.decode.variants import DecodeVariant

args = sys.argv[2:] or ["128", "4", "float16", "token", "float32", "4", "4"]
variant = DecodeVariant(int(args[0]), int(args[1]), args[2], args[3], args[4], int(args[5]),
                        int(args[6]))
program = variant.compile(sys.argv[1].rsplit("/", 1)[0] and "sm_90")
open(sys.argv[1], "wb").write(program.cubin)
print(program.symbol(variant.split_kernel))
