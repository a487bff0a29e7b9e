"""L layers' worth of one workload's inputs on the device, all distinct (so replaying the
step streams L different caches, as a real model does), and the correctness check of layer 0
against the float64 oracle."""
from __future__ import annotations

import numpy as np

from lowlevel_fd.driver import Device, DeviceArray, Stream
from lowlevel_fd.driver.dtypes import as_dtype
from lowlevel_fd.reference import decode_attention_ref

from .kernels import copy_pitched, fill_random
from .pages import bnsh_from_pages, page_ids
from .workloads import Workload

# int8 bytes uniform on [-128, 127] have a standard deviation of ~74: scales around 1/74 give
# dequantized K/V of unit size, hence scores of unit size and a softmax that is neither flat
# nor one-hot, so the check exercises the whole online-softmax path.
SCALE_CENTER = 1.0 / 74
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
# Above this many reference tokens (B x S) only a few rows are checked: the float64 oracle
# dequantizes whole rows and would dominate the run time of the large shapes.
FULL_CHECK_TOKENS = 1 << 16


def _slot_arrays(workload: Workload, scales: list[np.ndarray], seed: int, device: Device,
                 stream: Stream) -> dict[str, DeviceArray]:
    """One layer's pools as views of one allocation of page slots (``PageSlot``): random
    bytes, then the scales scattered into each slot."""
    slot = workload.slot()
    buffer = DeviceArray.empty((workload.num_pages, slot.nbytes), np.uint8, device)
    fill_random(buffer, seed, stream)
    block = DeviceArray.from_numpy(slot.scale_block(*scales), device)
    at = slot.offsets()
    copy_pitched(buffer.ptr + at["k_scale"], slot.nbytes, block, stream)
    stream.synchronize()
    block.close()
    arrays = {"slot": buffer}  # closed with the views (which only borrow it)
    for name, dtype, shape, strides in (
            ("k", np.int8, workload.cache_shape, slot.row_strides),
            ("v", np.int8, workload.cache_shape, slot.row_strides),
            ("k_scale", scales[0].dtype, workload.scale_shape, slot.scale_strides),
            ("v_scale", scales[0].dtype, workload.scale_shape, slot.scale_strides)):
        arrays[name] = DeviceArray(buffer.ptr + at[name], shape, dtype, device, strides,
                                   owner=buffer)
    return arrays


class LayerSet:
    """Per layer: random int8 K/V caches (device-filled), positive random scales, a random
    query and an output buffer; one device copy of the lengths is shared by all layers."""

    def __init__(self, workload: Workload, num_layers: int, device: Device, stream: Stream,
                 seed: int = 0) -> None:
        self.workload, self.num_layers, self.device = workload, num_layers, device
        rng = np.random.default_rng(seed)
        self.host_lengths = workload.seq_lens()
        self.seq_lens = DeviceArray.from_numpy(self.host_lengths.astype(np.int32), device)
        q_dtype = as_dtype(workload.q_dtype)
        scale_dtype = np.float32 if workload.scale_mode != "token" else workload.scale_dtype
        q_shape = (workload.batch, workload.num_q_heads, workload.head_dim)
        self.layers: list[dict[str, DeviceArray]] = []
        self.host_q0 = None
        for layer in range(num_layers):
            scales = [(rng.uniform(0.5, 1.5, workload.scale_shape) * SCALE_CENTER).astype(
                scale_dtype) for _ in range(2)]
            if workload.page_slot:
                arrays = _slot_arrays(workload, scales, seed * 1_000_003 + 2 * layer, device,
                                      stream)
            else:
                arrays = {}
                for name in ("k", "v"):
                    arrays[name] = DeviceArray.empty(workload.cache_shape, np.int8, device)
                    fill_random(arrays[name], seed * 1_000_003 + 2 * layer + (name == "v"),
                                stream)
                for name, host in zip(("k_scale", "v_scale"), scales):
                    arrays[name] = DeviceArray.from_numpy(host, device)
            q = rng.standard_normal(q_shape).astype(np.float32).astype(q_dtype)
            arrays["q"] = DeviceArray.from_numpy(q, device)
            arrays["out"] = DeviceArray.empty(q_shape, q_dtype, device)
            if layer == 0:  # the oracle checks layer 0 only
                self.host_q0 = q
            self.layers.append(arrays)
        # Paged: one block table for every layer (as in an engine), the pages of each
        # sequence in random physical order unless the workload asks for another (page_ids).
        self.table = None
        self.pages: dict = {}
        if workload.page_size:
            count = workload.num_pages
            order = page_ids(workload.page_order, count,
                             workload.page_size * workload.num_kv_heads * workload.head_dim, rng,
                             workload.pages_per_seq)
            self.table = order.reshape(workload.batch, workload.pages_per_seq).astype(np.int32)
            self.pages = {"block_table": DeviceArray.from_numpy(self.table, device)}
        stream.synchronize()
        self._reference: tuple[list[int], np.ndarray] | None = None

    def set_lengths(self, lengths) -> None:
        """Replace every layer's lengths (host and device copy) before the first check: edge
        cases such as empty rows and tile boundaries in the probes' oracle tests."""
        self.host_lengths = np.asarray(lengths, dtype=np.int64)
        self.seq_lens.close()
        self.seq_lens = DeviceArray.from_numpy(self.host_lengths.astype(np.int32), self.device)
        self._reference = None

    def args(self, layer: int) -> tuple:
        """The positional arguments of ``DecodePlan.run`` for one layer."""
        a = self.layers[layer]
        return (a["q"], a["k"], a["v"], a["k_scale"], a["v_scale"], self.seq_lens, a["out"])

    # -- correctness ----------------------------------------------------------------------------
    def check_rows(self) -> list[int]:
        batch = self.workload.batch
        if batch * self.workload.seq_len <= FULL_CHECK_TOKENS:
            return list(range(batch))
        return sorted({0, batch // 2, batch - 1})

    def reference(self) -> tuple[list[int], np.ndarray]:
        """(rows, float64 oracle output [rows, Hq, D]) of layer 0; computed once."""
        if self._reference is None:
            w, a, rows = self.workload, self.layers[0], self.check_rows()

            def row_stack(array: DeviceArray) -> np.ndarray:
                if self.table is None:
                    return np.stack([array[b].numpy() for b in rows])
                return np.stack([self._gather(array, b) for b in rows])

            per_row = w.scale_mode == "token"
            k_scale = row_stack(a["k_scale"]) if per_row else a["k_scale"].numpy()
            v_scale = row_stack(a["v_scale"]) if per_row else a["v_scale"].numpy()
            layout = "bnsh" if self.table is not None else w.kv_layout
            out, _ = decode_attention_ref(
                self.host_q0[rows], row_stack(a["k"]), row_stack(a["v"]), k_scale, v_scale,
                self.host_lengths[rows], kv_layout=layout, scale_mode=w.scale_mode)
            self._reference = (rows, out)
        return self._reference

    def _gather(self, pool: DeviceArray, b: int) -> np.ndarray:
        """Sequence b's tokens from its pages: ``[Hkv, S, D]`` (caches) or ``[Hkv, S]``
        (scales), as a contiguous bnsh row."""
        pages = np.stack([pool[int(page)].numpy() for page in self.table[b]])
        order = np.arange(len(pages))[None]  # the fetched pages, in the row's order
        rows = bnsh_from_pages(pages, order, self.workload.kv_layout)[0]
        return rows[:, :self.workload.seq_len]

    def check_output(self) -> dict:
        """Compare layer 0's output (already computed and synchronized) with the oracle:
        max|out - ref| / max|ref| over the checked rows, plus non-finite values anywhere."""
        rows, ref = self.reference()
        out = self.layers[0]["out"].numpy().astype(np.float64)
        non_finite = int(np.count_nonzero(~np.isfinite(out)))
        diff = np.abs(out[rows] - ref)
        err = float(diff.max() / max(np.abs(ref).max(), 1e-30)) if np.isfinite(diff).all() \
            else float("inf")
        tolerance = TOLERANCE[self.workload.q_dtype]
        return {"rows": rows, "max_rel_err": err, "tolerance": tolerance,
                "non_finite": non_finite, "ok": err <= tolerance and non_finite == 0}

    def close(self) -> None:
        for arrays in self.layers:
            for array in arrays.values():
                array.close()

        self.layers.clear()
        self.seq_lens.close()
        for array in self.pages.values():
            array.close()
