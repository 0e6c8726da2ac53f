"""TensorRT plans for the backbone: optimization profiles, the trtexec command, and a build through the Python API.

TensorRT cannot be installed on the development machines: `tensorrt` is imported only inside `build_plan`. The
profiles and commands are generated and tested here; the build itself runs on the GPU it will serve on (the
`engine-builder` service of docker-compose.yml runs the script this module writes, in the TensorRT container of the
Triton release, which has trtexec). Each plan is checked before Triton may start: Polygraphy runs it on inputs saved
at export and compares its outputs with ONNX Runtime's outputs saved beside them (`write_parity_data`); a plan that
differs is deleted and the builder fails, so compose never starts Triton on it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aot.serving import protocol


@dataclass(frozen=True)
class Profile:
    """Shapes the engine is optimized for (min / opt / max). Sequence lengths are the tokenizer's buckets.

    The aot_rows maximum is batch * sequence * L * d elements (every token distinct): the engine allocates it.
    """

    min_batch: int = 1
    opt_batch: int = 8
    max_batch: int = 32
    min_seq: int = 1
    opt_seq: int = 128
    max_seq: int = 512

    def shapes(self, inputs: list[str], num_layers: int, hidden: int) -> dict[str, tuple[tuple, tuple, tuple]]:
        out = {}
        for name in inputs:
            if name == protocol.AOT_ROWS:
                per = num_layers * hidden
                out[name] = ((per,), (self.opt_batch * self.opt_seq * per,), (self.max_batch * self.max_seq * per,))
            elif name == protocol.AOT_ROW_OFFSETS:
                out[name] = ((self.min_batch + 1,), (self.opt_batch + 1,), (self.max_batch + 1,))
            elif name == protocol.AOT_BIAS:
                out[name] = ((self.min_batch, self.min_seq, num_layers, hidden),
                             (self.opt_batch, self.opt_seq, num_layers, hidden),
                             (self.max_batch, self.max_seq, num_layers, hidden))
            else:
                out[name] = ((self.min_batch, self.min_seq), (self.opt_batch, self.opt_seq),
                             (self.max_batch, self.max_seq))
        return out


def trtexec_command(onnx: str, plan: str, shapes: dict, fp16: bool, trtexec: str = "trtexec") -> str:
    def spec(k: int) -> str:
        return ",".join(f"{name}:{'x'.join(str(v) for v in dims[k])}" for name, dims in shapes.items())

    args = [trtexec, f"--onnx={onnx}", f"--saveEngine={plan}", f"--minShapes={spec(0)}", f"--optShapes={spec(1)}",
            f"--maxShapes={spec(2)}"] + (["--fp16"] if fp16 else [])
    return " ".join(shlex.quote(a) for a in args)


PARITY_INPUTS, PARITY_OUTPUTS = "parity_inputs.json", "parity_outputs.json"
# Plan against ONNX Runtime fp32 on the pooled states: fp32 plans agree to ~1e-5; fp16 ones to ~1e-2.
PARITY_TOLERANCE = {False: 1e-3, True: 5e-2}


def write_parity_data(onnx: Path, feeds: dict[str, np.ndarray], folder: Path) -> None:
    """Inputs and ONNX Runtime's outputs for them, in Polygraphy's JSON formats (`polygraphy run --load-inputs /
    --load-outputs`), beside the graph: what build_engines.sh checks each plan against."""
    import onnxruntime as ort
    from polygraphy.comparator import IterationResult, RunResults
    from polygraphy.json import save_json

    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(names, feeds), strict=True))
    save_json([feeds], folder / PARITY_INPUTS)
    results = RunResults()
    results.append(("onnxrt-runner", [IterationResult(outputs, runner_name="onnxrt-runner")]))
    results.save(str(folder / PARITY_OUTPUTS))


def parity_command(folder: str, fp16: bool, plan: str | None = None, polygraphy: str = "polygraphy") -> str:
    """Polygraphy: run `plan` (TensorRT) on the saved inputs and compare with the saved ONNX Runtime outputs. Without
    `plan`, the raw graph under ONNX Runtime (how the saved files are checked where TensorRT is absent)."""
    tol = PARITY_TOLERANCE[fp16]
    model = ([plan, "--model-type", "engine", "--trt"] if plan else [f"{folder}/model.raw.onnx", "--onnxrt"])
    args = [polygraphy, "run", *model, "--load-inputs", f"{folder}/{PARITY_INPUTS}",
            "--load-outputs", f"{folder}/{PARITY_OUTPUTS}", "--atol", str(tol), "--rtol", str(tol)]
    return " ".join(shlex.quote(a) for a in args)


def build_script(models: dict[str, dict], fp16: bool) -> str:
    """A POSIX shell script that builds every missing plan with trtexec and checks it with Polygraphy against ONNX
    Runtime (run in the TensorRT container of the Triton release, on the serving GPU). A plan that differs is
    deleted and the script fails, naming it: Triton is not started on it."""
    lines = ["#!/bin/sh",
             "# Generated by `aot export backbone --format tensorrt`: builds missing TensorRT plans and checks them.",
             "set -eu", 'cd "$(dirname "$0")"',
             'TRTEXEC=${TRTEXEC:-$(command -v trtexec || echo /usr/src/tensorrt/bin/trtexec)}',
             'if ! command -v polygraphy >/dev/null 2>&1; then',
             '  pip install --quiet polygraphy || { echo "build_engines.sh: polygraphy is missing and could not be '
             'installed: plans cannot be checked" >&2; exit 1; }',
             'fi']
    for name, spec in models.items():
        folder = f"models/{name}/1"
        plan, onnx = f"{folder}/model.plan", f"{folder}/model.raw.onnx"
        cmd = trtexec_command(onnx, plan, spec["shapes"], fp16, trtexec="$TRTEXEC").replace("'$TRTEXEC'", '"$TRTEXEC"')
        check = parity_command(folder, fp16, plan)
        lines += [f'if [ ! -s {plan} ]; then', f'  echo "building {plan}"', f"  {cmd}", "fi",
                  f'echo "checking {plan} against ONNX Runtime"',
                  f'if ! {check}; then',
                  f'  rm -f {plan}',
                  f'  echo "build_engines.sh: {plan} differs from ONNX Runtime beyond {PARITY_TOLERANCE[fp16]:g} '
                  '(Polygraphy output above); deleted, Triton will not start on it" >&2',
                  "  exit 1", "fi"]
    return "\n".join(lines) + "\n"


def build_plan(onnx: Path, plan: Path, shapes: dict, fp16: bool) -> None:
    """Build a serialized plan with the TensorRT Python API (only where tensorrt is installed)."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise RuntimeError("tensorrt is not installed here: the repository keeps model.raw.onnx and "
                           "build_engines.sh; `docker compose up` builds the plans on the GPU") from exc
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx}")
    tmp = plan.with_name(plan.name + ".tmp")
    tmp.write_bytes(bytes(serialized))
    tmp.replace(plan)
