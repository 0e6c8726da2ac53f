"""The backbone on ONNX Runtime, batched exactly as Triton's native backend batches single-sequence requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving import protocol


def length_groups(lengths: list[int], max_padding: float) -> list[list[int]]:
    """The batch's indexes split into runs of similar length, longest first: a run takes the next longest sequence
    while padding every one to the run's longest adds at most `max_padding` of its real tokens (0: equal lengths
    only). On a CPU padded tokens cost as much as real ones, so one batch of mixed lengths is slower than a few of
    similar lengths (measured in `aot bench tax`)."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    groups: list[list[int]] = []
    real = 0
    for k in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= (1 + max_padding) * (real + lengths[k]):
            groups[-1].append(k)
            real += lengths[k]
        else:
            groups.append([k])
            real = lengths[k]
    return groups


class BackboneRunner:
    """Token tensors padded to the longest sequence of each length group (length_groups), and the AoT bias in the
    graph's interface: ragged rows concatenated with the accumulated row offsets, or each request's dense bias
    rows[index] (zero past its end)."""

    def __init__(self, onnx_path: str | Path, threads: int = 0, providers: list[str] | None = None,
                 max_padding: float | None = 0.125):
        """`max_padding`: see length_groups; None pads the whole batch to its longest sequence, as Triton's native
        backends do."""
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Idle intra-op threads sleep instead of spinning: the served backbone shares its cores with tritonserver, the
        # other steps and often the clients, and spinning threads burned half the backbone's CPU on the 2-core
        # machine (12,500-17,500 us of CPU per sequence against 5,300-6,600 without, at 2x the throughput).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(onnx_path), options,
                                            providers=providers or ["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.dense = protocol.AOT_BIAS in self.inputs
        self.aot = self.dense or protocol.AOT_ROWS in self.inputs
        if self.dense:  # [batch, sequence, L, d]: the row shape is fixed in the graph
            shape = next(i.shape for i in self.session.get_inputs() if i.name == protocol.AOT_BIAS)
            self.row_shape = tuple(int(n) for n in shape[2:])
        self.max_padding = max_padding

    def run(self, requests: list[dict[str, np.ndarray]]) -> np.ndarray:
        """Each request: 1-D token tensors (and aot_rows, aot_index for AoT). Returns the pooled states [B, P, d] in
        the requests' order."""
        if self.max_padding is None or len(requests) == 1:
            return self._run(requests)
        groups = length_groups([len(r[protocol.INPUT_IDS]) for r in requests], self.max_padding)
        if len(groups) == 1:
            return self._run(requests)
        pooled = None
        for group in groups:
            out = self._run([requests[k] for k in group])
            if pooled is None:
                pooled = np.empty((len(requests), *out.shape[1:]), out.dtype)
            pooled[group] = out
        return pooled

    def _run(self, requests: list[dict[str, np.ndarray]]) -> np.ndarray:
        longest = max(len(r[protocol.INPUT_IDS]) for r in requests)
        feeds = {}
        for name in protocol.token_inputs(protocol.TOKEN_TYPE_IDS in self.inputs):
            feeds[name] = np.stack([np.pad(r[name], (0, longest - len(r[name]))) for r in requests])
        if self.dense:
            bias = np.zeros((len(requests), longest, *self.row_shape), protocol.ROWS_DTYPE)
            for b, r in enumerate(requests):
                index = r[protocol.AOT_INDEX]
                bias[b, :len(index)] = protocol.dense_bias(r[protocol.AOT_ROWS].reshape(-1, *self.row_shape), index)
            feeds[protocol.AOT_BIAS] = bias
        elif self.aot:
            feeds[protocol.AOT_INDEX] = np.stack([np.pad(r[protocol.AOT_INDEX], (0, longest - len(r[protocol.AOT_INDEX])))
                                                  for r in requests]).astype(protocol.INDEX_DTYPE)
            rows = [r[protocol.AOT_ROWS].reshape(-1) for r in requests]
            feeds[protocol.AOT_ROWS] = np.concatenate(rows).astype(protocol.ROWS_DTYPE, copy=False)
            feeds[protocol.AOT_ROW_OFFSETS] = np.concatenate([[0], np.cumsum([len(x) for x in rows])]).astype(
                protocol.INDEX_DTYPE)
        return self.session.run([protocol.POOLED_HIDDEN], feeds)[0]
