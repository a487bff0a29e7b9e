"""Compile the multi-token kernels into the compile cache in parallel (a fresh machine's
warm-up before the multi tests and benchmarks; `python -m lowlevel_fd compile --cache` builds
every family)."""
from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from lowlevel_fd.multi import shipped_variants


def main() -> int:
    arch = sys.argv[1] if len(sys.argv) > 1 else "sm_90"
    variants = [v for v in shipped_variants() if v.builds_for(arch)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda v: v.compile(arch), variants))
    print(f"compiled {len(variants)} multi-token programs for {arch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
