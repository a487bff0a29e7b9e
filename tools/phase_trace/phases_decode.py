#!/usr/bin/env python3
"""Where each layer of a DecodeStep graph spends its time, per phase (PERF_NOTES v38).

Needs a scratch build with trace marks: copy trace_marks.cuh into lowlevel_fd/cu/,
`git apply tools/phase_trace/decode_marks.patch`, run on the device, and revert
(`git checkout lowlevel_fd/cu && rm lowlevel_fd/cu/trace_marks.cuh`):

    PYTHONPATH=.:tools python3 tools/phase_trace/phases_decode.py --kv-layout hnd --page-size 16

Takes tools/decode_loop.py's arguments. Builds its layers and step, captures the step's graph,
replays it (events), then zeroes the trace counters, replays once more and prints, per layer,
microseconds: `period` from the previous layer's first CTA entry, `after_prev` from the previous
layer's last CTA end to this layer's first wait returning, and medians over the CTAs of `pre`
(entry to the prologue's copies issued, early reads), `wait` (entry to the programmatic wait
returning), `staged` (the wait to the new token staged and q loaded), `loop` (to the stream's
end), `merge` (to the CTA's slot stored) and `end` (last CTA end from the layer's first entry).
"""
from __future__ import annotations

import sys

import numpy as np

from phase_trace.phases import read_records, reset, trace_buffers

MARKS = ("entry", "wait", "prologue", "staged", "loop", "merged", "end")


def layer_rows(stamps: np.ndarray, layers: int) -> list[dict[str, float]]:
    """Per layer (records cut into ``layers`` equal groups by entry time), microseconds."""
    stamps = stamps[np.argsort(stamps[:, 0], kind="stable")]
    per = len(stamps) // layers
    m = {name: i for i, name in enumerate(MARKS)}
    rows, previous = [], None
    for i in range(layers):
        c = stamps[i * per:(i + 1) * per].astype(np.float64) / 1e3
        first = c[:, m["entry"]].min()

        def median(a, b):
            return float(np.median(c[:, m[b]] - c[:, m[a]]))

        row = {"period": first - previous[:, m["entry"]].min() if previous is not None else 0.0,
               "after_prev": (c[:, m["wait"]].min() - previous[:, m["end"]].max()
                              if previous is not None else 0.0),
               "spread": float(c[:, m["entry"]].max() - first),
               "pre": median("entry", "prologue") if np.all(c[:, m["prologue"]] < c[:, m["wait"]])
               else float("nan"),
               "wait": median("entry", "wait"), "staged": median("wait", "staged"),
               "loop": median("staged", "loop"), "merge": median("loop", "merged"),
               "end": float(c[:, m["end"]].max() - first)}
        rows.append(row)
        previous = c
    return rows


def main(argv: list[str] | None = None) -> int:
    import decode_loop
    from lowlevel_fd.driver import Device, Stream

    args = decode_loop.build_parser().parse_args(argv)
    device = Device(0)
    with Stream(device) as stream:
        loop = decode_loop.Loop(args, device, stream)
        try:
            with loop.step.capture(loop.buffers, loop.seq_lens, stream) as graph:
                graph.upload(stream)
                samples, _ = decode_loop.timed_pass(loop, lambda: graph.launch(stream))
                print(f"us per layer (events, median of {args.steps}): "
                      f"{np.median(samples) / args.layers:.2f}")
                buffers = trace_buffers()
                if not buffers:
                    print("no trace marks in the loaded kernels: apply the patch first",
                          file=sys.stderr)
                    return 1
                loop.restore()  # the initial lengths: the traced step stays within capacity
                graph.launch(stream)  # one untraced step first (warm), then the traced one
                stream.synchronize()
                reset(buffers)
                graph.launch(stream)
                stream.synchronize()
            stamps = read_records(buffers).get(1, np.zeros((0, 7), np.int64))
        finally:
            loop.close()
    print(f"{len(stamps)} CTA records over {args.layers} layers")
    rows = layer_rows(stamps, args.layers)
    keys = list(rows[0])
    print("layer " + " ".join(f"{k:>10}" for k in keys))
    for i, row in enumerate(rows):
        print(f"{i:>5} " + " ".join(f"{row[k]:>10.2f}" for k in keys))
    print("mean  " + " ".join(f"{np.nanmean([r[k] for r in rows[1:]]):>10.2f}" for k in keys)
          + "  (layers 1..)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
