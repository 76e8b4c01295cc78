"""Side-by-side benchmark of protrain_fx against the peers on the B24 protocol (../shared/anchors.md).

Each (size, system) trains in its own process (an OOM in one must not poison the next): the GPT of
``examples/gpt.py`` (or, with ``--model llama1b``, a Hugging Face ``LlamaForCausalLM`` of 1.1B
parameters with no pretrained weights) at batch 8 x 1024, bf16 autocast, AdamW, on a GPU capped at
``--cap-gib`` GiB with ``torch.cuda.set_per_process_memory_fraction`` (before anything is allocated),
2 warm-up steps and ``--steps`` timed steps (each followed by a device sync; ``--stream-steps N``
adds N steps with none between them, as a training loop runs: ``stream_step_s``). Per run:
tokens/s, step time, peak allocated and reserved GPU memory, host RAM peak, loss after the timed
steps, MFU against the measured 786 TFLOP/s (for a plan the backend chose, ``compute_bound_tok_s`` too: tokens over
the cost model's forward + backward compute, nothing recomputed or moved: the bound where nothing holds the whole step
to compare with), or the OOM / crash and its reason; and where the time
went: ``wall_s`` (the whole process, compile included), ``start_s`` (when it began, seconds into
this call), ``setup_s`` (imports, CUDA start), ``build_s`` (model and optimizer), ``first_step_s``
(first step, compile included), ``warmup_s``.

    python bench/peers.py --sizes 350M 760M --out OUT            # every system at each size
    python bench/peers.py --ladder --sizes 350M 760M 1.3B --out OUT  # per system, up to its first failure
    python bench/peers.py --model llama1b --systems protrain compile --out OUT   # the 1.1B Llama
    python bench/peers.py --ladder ... --deadline-s 560 --resume EARLIER/peers.json  # a second call
    python bench/peers.py --report OUT/peers.json --out OUT      # peers.md and plots again
    python bench/peers.py --device cpu --sizes tiny --seq 32 --out OUT  # dry run (also --model llama_tiny)
    python bench/peers.py --protocol B24-L --sizes 4.2B --systems protrain_offload deepspeed --offload auto --out OUT
    python bench/peers.py --dp 2 --sizes 4.2B --systems protrain_offload fsdp2 deepspeed --offload auto --out OUT

Time budget. Runs go size by size (every system at 350M, then the survivors at 760M, ...), and
``OUT/peers.json`` and ``OUT/peers.md`` are rewritten after every run, so a call cut off at its time
limit keeps every finished run. ``--deadline-s N`` bounds the whole call: a run is not started when
less time is left than an estimate for it (the longest ``wall_s`` of that system so far, else
``--default-estimate-s``), each run's timeout is the smaller of ``--timeout`` and the time left, and
runs left out are recorded as ``not_run`` with the reason. ``--resume FILE.json`` starts from an
earlier call's results: pairs already there are skipped, ``not_run`` ones are run, and the ladder
goes on where it stopped. The call ends by printing the command that resumes it.

Host RAM. Before an offloading peer (fsdp2, deepspeed) starts, the host bytes it needs are estimated
(:data:`HOST_BYTES_PER_PARAM`) and compared with the memory available; when it cannot fit, the run
is recorded as ``skipped_host_ram`` (an estimate, not a measured failure; it ends that system's
ladder). ``--no-host-ram-check`` runs it anyway.

DeepSpeed is benchmark-only and not on the GPU machine: build its wheel and its needs into the
git-ignored ``.whl/`` as ``../shared/anchors.md`` says (0.19.8 also imports einops, msgpack,
py-cpuinfo and ninja: download them the same way), carry ``.whl`` with the device call, and start
the command with ``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
export PYTHONPATH=/tmp/site`` (``bench/device.sh`` does); without it a DeepSpeed run records the
import error. Every run records the torch and DeepSpeed versions (``versions``).

Peers (``bench/peer_configs.py`` holds their configurations): fsdp2; deepspeed (ZeRO-3, parameters
and optimizer offloaded); superoffload (the same with ``offload_optimizer.super_offload``);
deepcompile (ZeRO-3 offload as FX passes, ``engine.compile()``); zenflow (ZeRO-2 with the optimizer
offloaded, selective updates: not exact, timed as the mean over whole update intervals).
Column ``exact`` says whether a system's update is AdamW's (its loss comparable with ours).
An OOM records its traceback; with ``PEERS_OOM_REPORT=1`` the allocator's history is recorded from
the end of the first step and the OOM records what held the device (``oom_blocks``: live bytes by
the innermost frame of ours, a peer's or Inductor's generated code that allocated them). With
``PEERS_TRACE=N`` a protrain run traces N more steps under ``torch.profiler`` after its timed ones
(``trace``: the top kernels, copies and CPU ops by time and the device's busy time a step, as
``bench/loops.py``'s ``trace`` flag records).

Protocols. ``--protocol B24`` (default) is one micro-batch per optimizer step; ``--protocol B24-L``
(or ``--accumulate K``) accumulates 8 (K) micro-batches of ``--batch`` x ``--seq``, each its own
tokens, per optimizer step: ``handle.accumulate()`` around all but the last backward for protrain
(and the backend option ``accumulation_steps``, so the plan is chosen for the accumulated step),
``gradient_accumulation_steps`` for DeepSpeed, ``set_requires_gradient_sync`` (FSDP2's ``no_sync``)
for FSDP2, plain summed gradients for the rest. Tokens/s count every micro-batch of the step.
``--clip MAX_NORM`` clips the gradients' global norm before each optimizer step as each system's users
do: ``clip_grad_norm_`` (for an offloaded model, its exact clip: every chunk's step waits for the norm),
DeepSpeed's ``gradient_clipping``. Each run records ``launch_to_last_step_s``, its process start to the
end of its last timed step.

Data-parallel mode. ``--dp N`` runs each (size, system) as ``python -m torch.distributed.run
--standalone --nproc_per_node N bench/peers.py -- --run SIZE SYSTEM ... --dp N`` (the ``--`` keeps
torchrun's parser off our options; that command also runs one pair by hand): one process per GPU of
this host, the default process group (NCCL, or gloo with ``--device cpu``) initialised before the
model is built, so ``protrain_fx.offload`` shards over it, FSDP2 shards over the world and DeepSpeed
uses it; each rank trains its own micro-batches and ``OMP_NUM_THREADS`` is the cores over N unless
set. Rank 0 reports: tokens/s of all ranks over the slowest rank's step, the mean loss, each rank's
peaks and step in ``ranks``, and on CUDA ``exposed_collective_s``: one more step traced with
``torch.profiler``, the time NCCL kernels run with no other kernel beside them
(``peer_configs.collective_times``). Only ``peer_configs.DATA_PARALLEL_SYSTEMS`` run under ``--dp``.

Systems: protrain (``torch.compile(backend="protrain")``, no plan: ``auto_plan=False``), protrain_plan (the same with a
hand-written activation plan, ``--plan``; the system is named ``protrain_plan[SPEC]``), eager,
eager_ac (every block checkpointed), compile, compile_amb0 / compile_amb05
(``activation_memory_budget`` 0 and 0.5), fsdp2 (FSDP2 ``CPUOffloadPolicy`` + AC, world size 1),
deepspeed, superoffload, deepcompile, zenflow (DeepSpeed's modes, + AC; when importable), and, only
when named in ``--systems``, protrain_offload (parameters in chunks, ``protrain_fx.offload``, most
of them in host memory with a CPU AdamW during backward, plus an activation plan; ``--offload``
gives its settings, the system is named ``protrain_offload[SPEC]``; its runs also record the
forward / backward / optimizer breakdown, the overlap table of ``peers.md``). ``--host-ram-gib``
emulates a host with that much free RAM on a larger one (the 2-GPU machine has 256 GiB). Writes
``OUT/peers.json``, ``OUT/peers.md``, one log per run in ``OUT/logs/`` and, when matplotlib is there,
``OUT/peers_throughput.png`` and ``OUT/peers_largest.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import json
import os
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

_PROCESS_START = time.monotonic()  # a run's setup_s counts its imports from here
ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "bench"):  # ``examples.gpt`` and ``protrain_fx`` from a source tree; peer_configs
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import peer_configs  # noqa: E402  (after the path)
from peer_configs import DATA_PARALLEL_SYSTEMS, DEEPSPEED_SYSTEMS, collective_times, merge_ranks  # noqa: E402

SYSTEMS = (
    "protrain", "protrain_plan", "protrain_offload", "eager", "eager_ac", "compile", "compile_amb0",
    "compile_amb05", "fsdp2", *DEEPSPEED_SYSTEMS,
)
#: ``--protocol`` → micro-batches accumulated per optimizer step (``../shared/anchors.md``; B24-L: issue 39).
PROTOCOLS = {"B24": 1, "B24-L": 8}
#: bf16 dense matmul rate of the H200, the denominator of MFU (``docs/results.md#the-gpu-machine``).
PEAK_FLOPS = 786e12
#: Statuses that end a system's ladder: it is not run at the larger sizes of the same model.
LADDER_STOPS = ("OOM", "crash", "timeout", "skipped_host_ram", "refused_host_ram")
#: Seconds of ``--deadline-s`` kept back for writing the results at the end.
RESERVE_S = 5.0
#: What a result records of the protocol; a resumed file must have been run with the same values.
PROTOCOL_KEYS = ("batch", "seq", "cap_gib", "steps", "warmup", "device", "accumulate", "world_size", "clip")

#: Host bytes per parameter the offloading peers need (``peer_configs.HOST_BYTES_PER_PARAM`` says why).
HOST_BYTES_PER_PARAM = peer_configs.HOST_BYTES_PER_PARAM
#: Host bytes of a training process before any model state (CUDA context, torch and its libraries).
HOST_BASE_BYTES = 3 * 2**30

#: Hugging Face Llama configurations (``transformers.LlamaConfig`` keywords); ``llama_tiny`` is for
#: CPU dry runs (``--seq`` at most 64).
LLAMA_SIZES = {
    "llama1.1B": {  # TinyLlama-1.1B's shape
        "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
        "intermediate_size": 5632, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    },
    "llama_tiny": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64,
    },
}
#: ``--model`` → the one size it trains (``gpt`` trains ``--sizes``).
MODELS = {"gpt": None, "llama1b": "llama1.1B", "llama_tiny": "llama_tiny"}

_PLAN_SYSTEM = re.compile(r"^protrain_plan\[(.+)\]$")
_OFFLOAD_SYSTEM = re.compile(r"^protrain_offload\[(.+)\]$")
#: Environment variable that caps the host RAM a run may use (bytes), for a machine with more RAM
#: than the one emulated (``--host-ram-gib``).
HOST_RAM_ENV = "PEERS_HOST_RAM_BYTES"


# ---------------------------------------------------------------------------------------------- models


def family(size: str) -> str:
    """``"llama"`` for a :data:`LLAMA_SIZES` size, else ``"gpt"`` (a preset of ``examples/gpt.py``)."""
    return "llama" if size in LLAMA_SIZES else "gpt"


def _gpt_config(size: str):
    from examples.gpt import gpt_config

    return gpt_config(size)


def num_params(size: str) -> int:
    """Parameters of the model of ``size`` (tied weights once), computed without building it."""
    if family(size) == "llama":
        c = LLAMA_SIZES[size]
        d, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        head_dim = d // heads
        attention = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d  # q, k, v, o
        layer = attention + 3 * d * c["intermediate_size"] + 2 * d  # gate, up, down; two RMSNorms
        return 2 * c["vocab_size"] * d + c["num_hidden_layers"] * layer + d  # untied embedding and head
    from examples.gpt import num_params as gpt_num_params

    return gpt_num_params(_gpt_config(size))


def n_layers(size: str) -> int:
    return LLAMA_SIZES[size]["num_hidden_layers"] if family(size) == "llama" else _gpt_config(size).n_layer


def block_labels(size: str) -> list[str]:
    """The block labels protrain_fx finds for this model (``protrain_fx.passes.blocks.find_blocks``:
    ``blocks.i`` for the GPT, ``model.layers.i`` for ``LlamaForCausalLM``; see
    tests/passes/test_checkpoint_plans.py and tests/analysis/test_blocks.py), in forward order."""
    container = "model.layers" if family(size) == "llama" else "blocks"
    return [f"{container}.{i}" for i in range(n_layers(size))]


def flops_per_token(size: str, seq: int) -> float:
    """Model FLOPs per trained token: 6N for the weights that do matmuls plus the attention scores
    and values, 12 * layers * attention width * sequence (PaLM appendix B)."""
    n = num_params(size)
    if family(size) == "llama":
        c = LLAMA_SIZES[size]
        matmul_params = n - c["vocab_size"] * c["hidden_size"]  # the input embedding is a lookup
        attention_width = c["num_attention_heads"] * (c["hidden_size"] // c["num_attention_heads"])
        return 6 * matmul_params + 12 * c["num_hidden_layers"] * attention_width * seq
    cfg = _gpt_config(size)
    matmul_params = n - cfg.block_size * cfg.n_embd  # position embeddings do no matmul (wte is the head)
    return 6 * matmul_params + 12 * cfg.n_layer * cfg.n_embd * seq


def build_model(size: str):
    """The model of ``size``, seeded, on the current default device."""
    import torch

    torch.manual_seed(0)
    if family(size) == "llama":
        import transformers

        config = transformers.LlamaConfig(
            **LLAMA_SIZES[size], use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa"
        )
        model = transformers.LlamaForCausalLM(config)
        model.loss_type = "ForCausalLM"  # as tests/analysis/test_blocks.py: no graph break in the loss-type lookup
        return model
    from examples.gpt import GPT

    return GPT(_gpt_config(size))


def _layers(model, size: str):
    return model.model.layers if family(size) == "llama" else model.blocks


def make_batch(size: str, batch: int, seq: int, device: str, seed: int = 0):
    """(inputs, targets) of random tokens drawn with ``seed``. The Llama's targets are its inputs:
    Hugging Face models shift the labels themselves."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    if family(size) == "llama":
        idx = torch.randint(0, LLAMA_SIZES[size]["vocab_size"], (batch, seq), generator=generator).to(device)
        return idx, idx
    from examples.gpt import random_batch

    return random_batch(_gpt_config(size), batch, seq, device=device, generator=generator)


def _loss_fn(run, size: str):
    """``loss_fn(inputs, targets)`` → the mean cross-entropy of model (or wrapper) ``run``."""
    if family(size) == "llama":
        return lambda idx, targets: run(input_ids=idx, labels=targets).loss
    return run  # GPT.forward(idx, targets) returns the loss


# ----------------------------------------------------------------------------------------------- plans


def parse_plan_spec(spec: str) -> tuple[int | None, int | None] | Path:
    """``"swap=2,checkpoint=10"`` → ``(2, 10)``: counts for ``protrain_fx.plan.interleaved``; ``all``
    stands for every block the other count leaves (``"checkpoint=all"`` → ``(0, None)``); a missing
    count is 0. A spec ending in ``.json`` is the path of a plan file (relative to the repository
    root). Raises ``ValueError`` naming what is wrong."""
    if spec.endswith(".json"):
        path = Path(spec)
        return path if path.is_absolute() else ROOT / path
    from protrain_fx.plan import parse_counts

    return parse_counts(spec)


def plan_from_spec(spec: str, labels: list[str]):
    """The ``protrain_fx.plan.Plan`` that ``spec`` (:func:`parse_plan_spec`) means for these blocks."""
    from protrain_fx.plan import from_counts, parse_plan

    parsed = parse_plan_spec(spec)
    if isinstance(parsed, Path):
        return parse_plan(str(parsed)).validate(labels)
    return from_counts(spec, labels)


def system_names(systems: list[str], plans: list[str], offloads: list[str] | None = None) -> list[str]:
    """``--systems`` with ``protrain_plan`` replaced by one ``protrain_plan[SPEC]`` per ``--plan``
    and ``protrain_offload`` by one ``protrain_offload[SPEC]`` per ``--offload``."""
    out = []
    for system in systems:
        if system == "protrain_plan":
            out += [f"protrain_plan[{spec}]" for spec in plans]
        elif system == "protrain_offload":
            out += [f"protrain_offload[{spec}]" for spec in offloads or ()]
        else:
            out.append(system)
    return list(dict.fromkeys(out))


def base_system(system: str) -> str:
    if _PLAN_SYSTEM.match(system):
        return "protrain_plan"
    return "protrain_offload" if _OFFLOAD_SYSTEM.match(system) else system


def parse_offload_spec(spec: str) -> tuple[int | str, int | str, str, int | str, int | str]:
    """``"persist=2,buffer=3,gpu_optim=1,lean=4,checkpoint=all"`` → ``(2, 3, "checkpoint=all", 1, 4)``;
    ``"auto"`` → ``("auto", "auto", "", "auto", "auto")`` (the backend chooses, for the device's cap;
    ``auto:inductor`` / ``auto:graph`` in ``--offload``: the same with ``options={"verify": ...}``;
    plain ``auto`` leaves the library's default, which judges by Inductor on a CUDA device):
    the chunks kept on the GPU, the GPU chunk buffers, the activation plan (``swap=``/``checkpoint=``
    counts, as ``--plan``; empty: none), the offloaded chunks stepped on the GPU and the lean chunks
    (no host bf16 copy; a number or ``auto``, the library's default). ``buffer`` is required;
    ``persist`` and ``gpu_optim`` default to 0."""
    if spec.strip() in ("auto", "auto:inductor", "auto:graph"):  # the backend chooses the counts and the plan (planner/offload.py)
        return "auto", "auto", "", "auto", "auto"
    counts: dict[str, int | str] = {"persist": 0, "gpu_optim": 0, "lean": "auto"}
    rest = []
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key.strip() == "lean" and value.strip() == "auto":
            continue
        if key.strip() in ("persist", "buffer", "gpu_optim", "lean"):
            if not value.strip().isdigit():
                raise ValueError(f"offload spec {spec!r}: {key.strip()} needs a whole number, got {value!r}")
            counts[key.strip()] = int(value)
        else:
            rest.append(part)
    if "buffer" not in counts:
        raise ValueError(f"offload spec {spec!r}: say how many GPU chunk buffers (buffer=N)")
    plan = ",".join(rest)
    if plan:
        parse_plan_spec(plan)  # raises on a bad plan
    return counts["persist"], counts["buffer"], plan, counts["gpu_optim"], counts["lean"]


# ------------------------------------------------------------------------------------------ the worker


def _checkpoint_blocks(model, size: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    layer_class = type(_layers(model, size)[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_class))


def build(system: str, size: str, device: str, accumulate: int = 1, batch: int = 8, clip: float = 0.0) -> tuple:
    """(step function, model, extra result fields) for one system. The step takes the micro-batches
    of one optimizer step (``accumulate`` of them, each ``(inputs, targets)``), runs their forward
    and backward, accumulating gradients, then (``clip`` > 0) clips the gradients' global norm to
    ``clip`` as each system's users do (``clip_grad_norm_``; DeepSpeed's ``gradient_clipping``), then
    the optimizer, and returns the mean of their losses."""
    import torch

    if system == "fsdp2":
        return _build_fsdp2(size, device, clip), None, {}
    if system in DEEPSPEED_SYSTEMS:
        return _build_deepspeed(size, system, accumulate, batch, clip)
    if _OFFLOAD_SYSTEM.match(system):
        return _build_offload(_OFFLOAD_SYSTEM.match(system).group(1), size, device, accumulate, clip)
    # Built on the device (its RNG, so every system here starts from the same weights): a CPU init
    # of billions of parameters would take a large share of the time budget.
    with torch.device(device):
        model = build_model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    info: dict = {}
    plan_spec = _PLAN_SYSTEM.match(system)
    if system == "eager_ac":
        _checkpoint_blocks(model, size)
    if system in ("eager", "eager_ac"):
        run = model
    elif system == "protrain" or plan_spec:
        from protrain_fx.backend import register

        register()
        # "protrain" is the step as written (the empty plan): no plan chosen from the capped device
        options: dict = {"auto_plan": False}
        if plan_spec:
            labels = block_labels(size)
            plan = plan_from_spec(plan_spec.group(1), labels)
            options["plan"] = plan
            info["plan"] = plan_spec.group(1)
            info["plan_blocks"] = {p: sum(plan.policy(b) == p for b in labels) for p in ("swap", "checkpoint", "none")}
        run = torch.compile(model, backend="protrain", options=options)
    else:
        budget = {"compile": None, "compile_amb0": 0.0, "compile_amb05": 0.5}[system]
        if budget is not None:
            torch._functorch.config.activation_memory_budget = budget
        run = torch.compile(model)
    autocast = device if device == "cuda" else None
    return _train_step(_loss_fn(run, size), optimizer, autocast=autocast, clip=clip), model, info


def _train_step(loss_fn, optimizer, autocast: str | None, no_sync=None, clip: float = 0.0):
    """Per micro-batch forward (under bf16 autocast on ``autocast``'s device, if given) and backward
    of its loss over their count, then (``clip`` > 0) ``clip_grad_norm_`` of the optimizer's
    parameters, then the optimizer step. ``no_sync(last)`` is called before each backward (FSDP2:
    reduce the gradients with the last only)."""
    import contextlib

    import torch

    def step(batches):
        losses = []
        for i, (idx, targets) in enumerate(batches):
            ctx = torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(idx, targets)
            if no_sync is not None:
                no_sync(i == len(batches) - 1)
            (loss / len(batches)).backward()
            losses.append(loss.detach())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).float().mean()

    return step


def _build_offload(spec: str, size: str, device: str, accumulate: int = 1, clip: float = 0.0) -> tuple:
    """protrain_fx with parameter chunks (``protrain_fx.offload``) and an activation plan. The step
    records, per call, GPU forward / backward / optimizer time (CUDA events; with accumulation, the
    last micro-batch's, and ``accumulated_s`` the micro-batches before it in ``handle.accumulate()``)
    and the CPU optimizer worker's busy time since the previous call, into ``info["breakdown"]``."""
    import contextlib

    import torch

    import protrain_fx
    from protrain_fx.backend import register

    verify = None
    if spec.strip() in ("auto:inductor", "auto:graph"):  # how plans are judged (option "verify")
        spec, verify = "auto", spec.strip().split(":")[1]
    n_persist, n_buffer, plan_spec, n_gpu_optim, n_lean = parse_offload_spec(spec)
    cuda = device == "cuda"
    local = torch.cuda.current_device() if cuda else 0  # the rank's GPU under --dp
    cap = torch.cuda.get_device_properties(local).total_memory if cuda else 0
    fraction = torch.cuda.get_per_process_memory_fraction(local) if cuda else 0.0
    if cuda and num_params(size) * 4 < 0.8 * cap * fraction and family(size) == "gpt":
        with torch.device(device):  # the GPU's RNG, as the other systems: the same weights
            model = build_model(size)
        where = "device"
    elif family(size) == "gpt":  # too large for the device: built on meta, materialised into the chunks
        with torch.device("meta"):
            model = build_model(size)
        where = "meta"
    else:
        model, where = build_model(size), "cpu"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    limit = os.environ.get(HOST_RAM_ENV)
    available = None
    if limit:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        available = int(limit) - rss
    counts = {} if n_persist == "auto" else {"n_persist": n_persist, "n_buffer": n_buffer, "n_gpu_optim": n_gpu_optim}
    # with a process group (--dp), offload shards the chunks over the ranks
    handle = protrain_fx.offload(model, optimizer, device=torch.device("cuda", local) if cuda else device, **counts,
                                 compute_dtype=torch.bfloat16 if cuda else None, available_host_bytes=available,
                                 init=model.init_parameter if where == "meta" else None, n_lean=n_lean)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1 and getattr(handle, "group", None) is None:  # --dp: ranks that do not shard train apart
        raise RuntimeError(f"protrain_fx.offload did not shard over the {world} ranks of the process group "
                           "(OffloadHandle.group is None): this protrain_fx trains one model per rank, not data-parallel")
    if cuda:
        torch.cuda.empty_cache()  # the initial fp32 weights of the offloaded chunks are gone
        torch.cuda.reset_peak_memory_stats()
    register()
    options = {"verify": verify} if verify else {}
    if accumulate > 1:
        options["accumulation_steps"] = accumulate  # the plan is chosen for the accumulated step
    info: dict = {"offload": {"n_persist": n_persist, "n_buffer": n_buffer, "n_gpu_optim": n_gpu_optim,
                              "n_lean": handle.n_lean, "n_lean_asked": n_lean, "built_on": where,
                              "chunks": len(handle.layout.chunks), "chunk_bytes": handle.layout.chunk_bytes,
                              "host_store_bytes": handle.store.host_bytes() if handle.store else 0,
                              "host_bytes_per_param": handle.host_bytes_per_param(), "sharded_over": world},
                  "breakdown": []}
    if plan_spec:
        labels = block_labels(size)
        plan = plan_from_spec(plan_spec, labels)
        options["plan"] = plan
        info["plan"] = plan_spec
        info["plan_blocks"] = {p: sum(plan.policy(b) == p for b in labels) for p in ("swap", "checkpoint", "none")}
    run = torch.compile(model, backend="protrain", options=options)
    loss_fn = _loss_fn(run, size)
    last_busy, last_wait, last_landing = [0.0], [0.0], [handle.landing_wait_s]
    last_adds = [0.0, 0.0]  # the store's accumulated adds: staging waits, seconds adding

    untimed = [False]  # run_one's stream phase: no events, no sync, no breakdown

    def step(batches):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if cuda and not untimed[0] else []
        if events:
            events[4].record()  # the step's start; events[0]: the last micro-batch's
        losses = []
        for idx, targets in batches[:-1]:  # accumulated: their chunks' steps wait for the last
            with torch.autocast(device, dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
                loss = loss_fn(idx, targets)
            with handle.accumulate():
                (loss / len(batches)).backward()
            losses.append(loss.detach())
        if events:
            events[0].record()
        ctx = torch.autocast(device, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(*batches[-1])
        if info["offload"]["n_persist"] == "auto":  # automatic counts: chosen by the compile just done
            info["offload"].update(n_persist=handle.n_persist, n_buffer=handle.n_buffer,
                                   n_gpu_optim=handle.n_gpu_optim, n_lean=handle.n_lean,
                                   host_store_bytes=handle.store.host_bytes() if handle.store else 0,
                                   host_bytes_per_param=handle.host_bytes_per_param())
        worker, device_adam = handle.worker, handle.device_adam
        if events and device_adam is not None and device_adam.timing is None:
            device_adam.timing = []  # time each device step (runtime/optim/device_adam.py)
        if not events and device_adam is not None:
            device_adam.timing = None
        if events:
            events[1].record()
        (loss / len(batches)).backward()
        losses.append(loss.detach())
        if events:
            events[2].record()
        if clip > 0:  # the offload's own clip: exact, every chunk's step held for the norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if events:
            events[3].record()
            events[3].synchronize()
            busy = worker.busy_s if worker else 0.0
            adds = handle.store.adds if handle.store else None
            # device steps still running are reported with the next step (no sync to perturb it)
            timing = (device_adam.timing or []) if device_adam else []
            n_done = next((i for i, t in enumerate(timing) if not t[2].query()), len(timing))  # in stream order
            timed = timing[:n_done]
            info["breakdown"].append({
                "accumulated_s": events[4].elapsed_time(events[0]) / 1e3,
                "forward_s": events[0].elapsed_time(events[1]) / 1e3,
                "backward_s": events[1].elapsed_time(events[2]) / 1e3,
                "gpu_optimizer_s": events[2].elapsed_time(events[3]) / 1e3,
                "cpu_optimizer_busy_s": busy - last_busy[0],  # steps run since the last call's end
                # backward's thread waiting for GPU optimizer steps in flight (runtime/optim/device_adam.py)
                "device_optimizer_wait_s": (device_adam.wait_s if device_adam else 0.0) - last_wait[0],
                # backward's thread waiting for a lean chunk's gradient landing buffer
                "landing_wait_s": handle.landing_wait_s - last_landing[0],
                # accumulated micro-batches: backward's thread waiting for a staging buffer (the adds
                # behind), and the worker's seconds adding (runtime/store/grad_adds.py)
                "staging_wait_s": adds.staging_wait_s - last_adds[0] if adds else 0.0,
                "host_add_s": adds.add_s - last_adds[1] if adds else 0.0,
                "staging_buffers": adds.staging_bytes // max(1, handle.store.chunk_numel * handle.store.compute_dtype.itemsize)
                if adds else 0,
                # each device step: chunk, seconds from its first copy in to its last copy out, and
                # when it started after this step's backward started
                "device_steps": [(c, a.elapsed_time(b) / 1e3, events[1].elapsed_time(a) / 1e3) for c, a, b in timed],
            })
            del timing[:n_done]
            last_landing[0] = handle.landing_wait_s
            last_adds[:] = (adds.staging_wait_s, adds.add_s) if adds else (0.0, 0.0)
            last_busy[0] = busy
            last_wait[0] = device_adam.wait_s if device_adam else 0.0
        return torch.stack(losses).float().mean()

    step.untimed = untimed
    return step, model, info


def _build_fsdp2(size: str, device: str = "cuda", clip: float = 0.0):
    """FSDP2 over the process group (world size 1 unless under ``--dp``): ``CPUOffloadPolicy`` and bf16
    mixed precision on CUDA (``../shared/anchors.md``); on the CPU (dry runs, gloo) neither. With
    accumulation, gradients are reduced with the last micro-batch only (``set_requires_gradient_sync``,
    FSDP2's ``no_sync``)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    if not dist.is_initialized():
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
            os.environ.setdefault(key, value)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if family(size) == "gpt":
        with torch.device("meta"):
            model = build_model(size)
        # Materialise on the CPU, where CPUOffloadPolicy keeps parameters; to_empty unties the tied
        # embedding / LM head, so tie again before initialising (else the model is not the one the
        # other systems train, and its loss is higher).
        model.to_empty(device="cpu")
        model.tie_weights()
        model.reset_parameters()
    else:
        model = build_model(size)  # on the CPU (no tied weights to restore)
    _checkpoint_blocks(model, size)
    policy = {
        "offload_policy": CPUOffloadPolicy(pin_memory=True),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    } if device == "cuda" else {}
    for block in _layers(model, size):
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return _train_step(_loss_fn(model, size), optimizer, autocast=None,  # FSDP2's policy casts to bf16
                       no_sync=model.set_requires_gradient_sync, clip=clip)


def _build_deepspeed(size: str, system: str = "deepspeed", accumulate: int = 1, batch: int = 8,
                     clip: float = 0.0) -> tuple:
    """One of DeepSpeed's modes (:data:`peer_configs.DEEPSPEED_SYSTEMS`, configured by
    ``peer_configs.deepspeed_config``) with activation checkpointing; ``deepcompile`` also calls
    ``engine.compile()``. Each micro-batch runs ``engine.backward`` and ``engine.step``, which steps
    at DeepSpeed's accumulation boundary (``gradient_accumulation_steps``; the loss is scaled there)."""
    import deepspeed  # benchmark-only peer; see anchors.md for carrying it to the GPU machine
    import torch

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29518")):
        os.environ.setdefault(key, value)
    config = peer_configs.deepspeed_config(system, micro_batch=batch, accumulation=accumulate,
                                           world_size=int(os.environ["WORLD_SIZE"]), clip=clip)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config) if config["zero_optimization"]["stage"] == 3 \
            else contextlib.nullcontext():
        model = build_model(size)
    if family(size) == "gpt" and config["zero_optimization"]["stage"] == 3:
        # zero.Init partitions each submodule's parameters as soon as it is built, so the GPT's own
        # init (reset_parameters at the end of GPT.__init__) ran on empty partitions and the model
        # kept nn.Linear / nn.Embedding defaults (N(0, 1) tied embedding) and a loss far above every
        # other system's (``docs/results.md#against-the-peers``). Initialise each parameter gathered.
        for name, p in model.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                model.init_parameter(name, p.data)
    _checkpoint_blocks(model, size)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if system == "deepcompile":
        engine.compile()
    loss_fn = _loss_fn(engine, size)

    def step(batches):
        losses = []
        for idx, targets in batches:
            loss = loss_fn(idx, targets)
            engine.backward(loss)
            engine.step()  # an optimizer step at the accumulation boundary only
            losses.append(loss.detach())
        return torch.stack(losses).float().mean()

    info = {"peer_config": config, "exact": peer_configs.exact(system)}
    return step, None, info


def run_one(size: str, system: str, *, steps: int, warmup: int, batch: int, seq: int, cap_gib: float,
            device: str, stream_steps: int = 0, accumulate: int = 1, clip: float = 0.0) -> dict:
    """Train ``size`` with ``system`` in this process; the result dict (never raises for a failed run).

    One step is ``accumulate`` micro-batches of ``batch`` x ``seq`` (each its own random tokens) and
    one optimizer step. Started by torchrun (``LOCAL_RANK`` and ``WORLD_SIZE`` set: ``--dp``), the
    process is one rank: it joins the default process group (NCCL on CUDA, gloo on the CPU) on its
    local GPU, feeds its own micro-batches, and the ranks' results are merged (``peer_configs.merge_ranks``);
    each rank returns the merged result."""
    import torch

    world, rank, local = _torchrun_ranks()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    if cuda and cap_gib:
        total = torch.cuda.get_device_properties(local).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), local)
    if world:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo")
    result: dict = {"size": size, "system": system, "versions": _versions(), "rank": rank,
                    "exact": peer_configs.exact(base_system(system)), "omp_threads": os.environ.get("OMP_NUM_THREADS")}
    result["setup_s"] = time.monotonic() - _PROCESS_START
    where = f"cuda:{local}" if cuda else device
    if system == "zenflow":  # time whole update intervals, after one (ZenFlow's tutorial settings)
        interval = peer_configs.ZENFLOW["update_interval"]
        steps, warmup = -(-steps // interval) * interval, max(warmup, interval)
        result["timed_as"] = f"mean over {steps} steps (a multiple of ZenFlow's update_interval {interval})"
    phase = time.perf_counter()
    try:
        step, _model, info = build(system, size, device, accumulate, batch, clip)
        result.update(info)
        batches = [make_batch(size, batch, seq, where, seed=(rank or 0) * accumulate + i) for i in range(accumulate)]
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        result["build_s"], phase = time.perf_counter() - phase, time.perf_counter()
        step(batches)
        sync()
        result["first_step_s"] = time.perf_counter() - phase
        if cuda and os.environ.get(OOM_REPORT_ENV):  # after the compile: its many allocations unrecorded
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        for _ in range(warmup - 1):
            step(batches)
        sync()
        result["warmup_s"] = time.perf_counter() - phase
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = step(batches)
            sync()
            times.append(time.perf_counter() - start)
        # launch (the process' start, its imports counted) to the end of the last timed step
        result["launch_to_last_step_s"] = time.monotonic() - _PROCESS_START
        step_s = statistics.fmean(times) if system == "zenflow" else statistics.median(times)
        if stream_steps:
            # How a training loop runs: no device sync between steps, so device work still queued at
            # one step's end (device optimizer steps on their own streams) overlaps the next step.
            # The timed steps above sync after each (and a protrain_offload step records events).
            # Wall time per step here, one sync at each end; the starts' spacing kept too.
            untimed = getattr(step, "untimed", None)
            if untimed is not None:
                untimed[0] = True
            starts = []
            sync()
            start = time.perf_counter()
            for _ in range(stream_steps):
                starts.append(time.perf_counter())
                loss = step(batches)
            sync()
            end = time.perf_counter()
            result.update(stream_step_s=(end - start) / stream_steps,
                          stream_starts_s=[t - start for t in starts], stream_end_s=end - start)
        result.update(status="ok", step_s=step_s, step_times_s=times, loss=float(loss.item()))
        if world and cuda:  # one more step, traced: the collectives' kernel time and what of it is exposed
            result.update(_collective_profile(lambda: step(batches), sync))
        if system.startswith("protrain") and int(os.environ.get(TRACE_ENV) or 0) > 0:
            from loops import traced

            result["trace"] = traced(lambda: step(batches), cuda, steps=int(os.environ[TRACE_ENV]))
    except torch.OutOfMemoryError as e:
        result.update(status="OOM", reason=str(e).splitlines()[0][:300], traceback=traceback.format_exc()[-3000:])
        if cuda and os.environ.get(OOM_REPORT_ENV):
            result["oom_blocks"] = oom_blocks(torch.cuda.memory._snapshot())
    except MemoryError as e:  # protrain_fx's chunk store refuses, before allocating, what the host cannot hold
        result.update(status="refused_host_ram", reason=str(e).splitlines()[0][:300])
    except Exception as e:  # noqa: BLE001  a crash is a result too: recorded with its reason
        first_line = str(e).splitlines()[0][:300] if str(e) else ""
        result.update(status="crash", reason=f"{type(e).__name__}: {first_line}",
                      traceback=traceback.format_exc()[-2000:])
    if cuda:
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(local)
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(local)
    if system.startswith("protrain"):
        result.update(_protrain_prediction())
        if cuda and result["status"] == "ok" and os.environ.get(REREAD_ENV):
            result["reread"] = _reread(int(os.environ[REREAD_ENV]))
    result["host_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if world:
        import torch.distributed as dist

        ranks: list = [None] * world
        dist.all_gather_object(ranks, result)
        dist.destroy_process_group()
        result = merge_ranks(ranks)
    if result["status"] == "ok":
        tokens = (world or 1) * accumulate * batch * seq  # every rank's micro-batches of one optimizer step
        result.update(tokens_per_step=tokens, tokens_per_s=tokens / result["step_s"],
                      mfu=tokens / result["step_s"] * flops_per_token(size, seq) / PEAK_FLOPS / (world or 1))
        compute_s = (result.get("auto_plan") or {}).get("compute_s")
        if compute_s:  # the physical bound where nothing holds the whole step to compare with (B24-L on an H100)
            result["compute_bound_tok_s"] = tokens / (accumulate * compute_s)
    return result


def _torchrun_ranks() -> tuple[int, int | None, int]:
    """``(world size, rank, local rank)`` of a process torchrun started (``LOCAL_RANK`` and
    ``WORLD_SIZE`` in the environment), else ``(0, None, 0)``: no process group."""
    if "LOCAL_RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, None, 0
    return int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])


def _versions() -> dict:
    """torch's and (without importing it) DeepSpeed's versions: a failed peer is recorded with them."""
    import importlib.metadata

    import torch

    try:
        deepspeed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed = None
    return {"torch": torch.__version__, "deepspeed": deepspeed}


def _collective_profile(run_step, sync) -> dict:
    """One step under ``torch.profiler`` (CUDA kernels): ``peer_configs.collective_times`` of its kernels."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_step()
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [(e["name"], e["ts"] * 1e-6, (e["ts"] + e.get("dur", 0)) * 1e-6)
               for e in events if e.get("cat") == "kernel"]
    return collective_times(kernels)


def _replan(replan) -> dict | None:
    """A ``planner.rates.Replan`` as plain data (``None``: the running plan was not changed)."""
    if replan is None:
        return None
    check = replan.step_check
    return {"before": replan.before.to_dict(), "after": replan.after.to_dict(), "predicted_s": replan.predicted_s,
            "before_s": replan.before_s, "after_s": replan.after_s,
            "measured_after_s": check.measured_step_s if check is not None else None,
            "calls": list(check.calls) if check is not None else None,
            "measured_before_s": replan.measured_before_s, "kept": replan.kept}


#: Environment variable: after a protrain run's timed steps, read the profile's inputs again on the
#: same host (:func:`_reread`), the device steps that many times.
REREAD_ENV = "PEERS_REREAD"
#: Set (to anything): the allocator's history is recorded from the end of the first step, and an OOM
#: records what held the device then (``oom_blocks``).
OOM_REPORT_ENV = "PEERS_OOM_REPORT"
#: Set to N > 0: a protrain run traces N more steps after its timed ones (``loops.traced``; ``trace``).
TRACE_ENV = "PEERS_TRACE"
#: Frames that say who allocated a block: the first one in these files, innermost first.
_OWNER_PARTS = ("/protrain_fx/", "/bench/", "/examples/", "torchinductor_", "/deepspeed/")


def oom_blocks(snapshot: dict, top: int = 40) -> list[dict]:
    """The device's live blocks in ``snapshot`` (``torch.cuda.memory._snapshot()``) grouped by the
    innermost frame in ``_OWNER_PARTS`` (blocks allocated before the recording have no frames: "before
    the recording"), largest total first: ``{"owner", "bytes", "blocks", "sizes"}`` (the largest few)."""
    groups: dict[str, list[int]] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            owner = next((f"{'/'.join(f['filename'].rsplit('/', 2)[-2:])}:{f['line']} {f['name']}" for f in frames
                          if any(part in f["filename"] for part in _OWNER_PARTS)),
                         "before the recording" if not frames else f"{frames[0]['filename']}:{frames[0]['line']}")
            groups.setdefault(owner, []).append(int(block["size"]))
    rows = [{"owner": k, "bytes": sum(v), "blocks": len(v), "sizes": sorted(v, reverse=True)[:4]}
            for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r["bytes"])[:top]


def _reread(device_steps: int) -> dict:
    """The profile's readings taken again after training, on the host that trained, into a copy of
    the profile files (the lane's cache is left as it was): per graph phase, the summed times of its
    matrix and attention nodes as the compile cached them (``cached``: with the device kept busy, as
    ``planner.problem.device_op_times`` times them; older result files hold the plain events protocol),
    timed afresh with 5 calls between two events (``events``) and with the device kept busy
    (``prefilled``, ``profile.ops._time_node``), and ``compute_scale``, what the compile multiplied its
    node times by (``planner.problem.IN_STEP_SCALE``); for a model with offloaded chunks, the device-step
    rate of its layout ``device_steps`` times and the CPU chunk step's rate twice
    (``profile.machine_profile.device_step_rate``, ``profile.machine_profile.chunk_adam_rate``). Any
    failure is recorded as its reason; the run's own results stand."""
    import shutil
    import tempfile

    import torch

    import protrain_fx
    from protrain_fx.planner import problem as planner_problem
    from protrain_fx.backend import placed_handle
    from protrain_fx.planner.offload import chunk_parts
    from protrain_fx.profile import cache as profile_cache
    from protrain_fx.profile import machine_profile
    from protrain_fx.profile import ops as opprofile

    out: dict = {}
    try:
        record = [g for g in protrain_fx.captured_graphs() if g.backward is not None and g.memory is not None][-1]
        device = torch.device(record.memory.device)
        phases = [list(record.forward.graph.nodes), list(record.backward.graph.nodes)]
        nodes = [n for ph in phases for n in ph]
        copy = Path(tempfile.mkdtemp(prefix="reread-"))
        machine = profile_cache.cache_path(device)
        if machine.exists():
            shutil.copy(machine, copy / machine.name)
        # what the compile priced the plans with (planner_problem.device_op_times), then both protocols afresh
        readings = {"cached": opprofile.measure_op_times(nodes, device, prefill=True),
                    "events": opprofile.measure_op_times(nodes, device, cache=copy, refresh=True),
                    "prefilled": opprofile.measure_op_times(nodes, device, cache=copy, refresh=True, prefill=True)}
        signatures = [[opprofile.op_signature(n) for n in ph] for ph in phases]
        common = set.intersection(*(set(r) for r in readings.values()))
        out["op_sums_s"] = {name: [sum(times[s] for s in sigs if s in common) for sigs in signatures]
                            for name, times in readings.items()}
        out["ops_timed"] = [sum(s in common for s in sigs) for sigs in signatures]
        out["compute_scale"] = planner_problem.IN_STEP_SCALE  # what the compile scaled its node times by
        handle = placed_handle(record)
        if handle is not None and device_steps > 0:
            parts = chunk_parts(handle.facts())
            out["device_step_bytes_per_s"] = [
                machine_profile.device_step_rate(device, parts, load_nodes=nodes, cache=copy, refresh=True)
                for _ in range(device_steps)]
            out["cpu_adam_params_per_s"] = [
                machine_profile.chunk_adam_rate(device, handle.chunk_params, cache=copy, refresh=True) for _ in range(2)]
        shutil.rmtree(copy, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - a measurement after the run; the run's results stand
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _protrain_prediction() -> dict:
    """What the backend predicted for the training graph (peak, swapped bytes, pool size)."""
    import protrain_fx
    from protrain_fx.runtime.swap import POOL
    from protrain_fx.search.cost import CostModel

    records = [g for g in protrain_fx.captured_graphs() if g.backward is not None and g.memory is not None]
    if not records:
        return {}
    record = records[-1]
    auto = {}
    if record.auto_plan is not None:  # chosen by the backend: what it chose and predicted
        a = record.auto_plan
        auto = {"auto_plan": {
            "config": a.config.to_dict(), "how": a.how, "offload": a.offload, "budget_bytes": a.budget_bytes,
            "budget_source": a.budget_source, "allocated_cap_bytes": a.allocated_cap_bytes,
            "predicted_step_s": a.estimate.step_s, "cost_model_peak_bytes": a.predicted_peak_bytes,
            "rate_spread": a.rate_spread,  # the predicted step: the mean over the host rates within it
            "analysed_peak_bytes": a.analysed_peak_bytes, "judged_by": a.judged_by,
            "search_s": a.search.seconds if a.search else None,
            "trials": len(a.trials), "trial_peaks": [(t.config.to_dict(), t.predicted_peak_bytes, t.analysed_peak_bytes,
                                                      t.by_inductor) for t in a.trials],
            "first_step_peak_bytes": a.measured_peak_bytes,
            # the backend's own step period (calls 3..8, wall time between starts; planner.rates.StepCheck)
            "backend_step_s": a.step_check.measured_step_s if a.step_check else None,
            # the runtime's CPU and device optimizer rates over those calls (protrain_fx.planner.rates)
            "training_rates": dataclasses.asdict(a.training_rates) if a.training_rates is not None else None,
            # n_gpu_optim chosen again at those rates (protrain_fx.planner.rates.Replan), and the step period
            # measured after it against its prediction; config and predicted_step_s stay the first plan's
            "replan": _replan(a.replanned),
            "problem_s": a.problem_s, "choose_s": a.choose_s, "from_cache": a.from_cache,
            "problem": a.problem.to_dict(),
            # the cost model's forward + backward compute of one micro-batch, nothing recomputed, moved or
            # waited for: what a device holding everything would take (compute_bound_tok_s)
            "compute_s": CostModel(a.problem).compute_s,
        }}
    return {
        **auto,
        "predicted_peak_bytes": record.memory.peak_bytes,
        "swapped_bytes": sum(s.nbytes for s in record.swapped),
        "swapped_values": len(record.swapped),
        "swap_est_d2h_s": sum(s.d2h_s for s in record.swapped),
        "swap_est_h2d_s": sum(s.h2d_s for s in record.swapped),
        "host_pool_bytes": POOL.nbytes(),
        "graphs": len(protrain_fx.captured_graphs()),
        # seconds of each phase of the compile (capture, planning, place, trial lowerings, codegen, store: the
        # wait for the chunk store filled beside the compile), as the plan table prints them
        "phases": dict(record.phases),
    }


# ------------------------------------------------------------------------------------------- host RAM


def host_bytes_needed(system: str, size: str, world_size: int = 1) -> int | None:
    """Estimated host bytes for an offloading peer on a node of ``world_size`` ranks
    (``peer_configs.host_bytes_per_param``: every rank's shards together, and each rank's base);
    None for the others."""
    per_param = peer_configs.host_bytes_per_param(system, world_size)
    return None if per_param is None else per_param * num_params(size) + world_size * HOST_BASE_BYTES


def host_bytes_available() -> tuple[int, str]:
    """(bytes, where from): ``--host-ram-gib`` when given, else MemAvailable of /proc/meminfo, or the
    cgroup's headroom when smaller."""
    if os.environ.get(HOST_RAM_ENV):
        return int(os.environ[HOST_RAM_ENV]), "--host-ram-gib"
    available, source = None, "MemAvailable"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # cgroup v2: a container's limit can be below what the host has free
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            headroom = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            if available is None or headroom < available:
                available, source = headroom, "cgroup memory.max - memory.current"
    except (OSError, ValueError):
        pass
    return (available if available is not None else 0), source


# ------------------------------------------------------------------------------------------ the ledger


class Ledger:
    """The results of this call and of the resumed one, one per (size, system), rewritten to
    ``out/peers.json`` and ``out/peers.md`` after every change."""

    def __init__(self, out: Path, previous: list[dict], *, force_host_ram: bool = False) -> None:
        self.out = out
        self.force_host_ram = force_host_ram
        self.results: dict[tuple[str, str], dict] = {(r["size"], r["system"]): r for r in previous}

    def add(self, result: dict, write: bool = True) -> None:
        self.results[(result["size"], result["system"])] = result
        if write:
            self.write()

    def done(self, size: str, system: str) -> bool:
        """Already has a result that a rerun would not change (``not_run`` is not one; nor is
        ``skipped_host_ram`` when the host RAM check is off)."""
        r = self.results.get((size, system))
        return r is not None and r["status"] != "not_run" and not self._forced(r)

    def _forced(self, r: dict) -> bool:
        return self.force_host_ram and r["status"] == "skipped_host_ram"

    def stopped(self, size: str, system: str) -> dict | None:
        """The failure that ends ``system``'s ladder before ``size`` (a smaller size of the same model
        that failed), or None. ``not_run`` is not a failure."""
        params = num_params(size)
        for r in self.results.values():
            if (r["system"] == system and family(r["size"]) == family(size) and num_params(r["size"]) < params
                    and r["status"] in LADDER_STOPS and not self._forced(r)):
                return r
        return None

    def estimate_s(self, system: str, size: str, default: float) -> tuple[float, str]:
        """(seconds, basis) a run of ``system`` is expected to take: the longest wall time of the
        system so far on this model at this size or a smaller one (a run cut off counts with the time
        it had), else the shortest at a larger size, else ``default``. (The longest at any size
        skipped a 350M run of a minute behind a 4.2B run of three and a half.)"""
        params = num_params(size)
        runs = [(num_params(r["size"]), r.get("wall_s") or r.get("cut_off_after_s") or 0.0)
                for r in self.results.values() if r["system"] == system and family(r["size"]) == family(size)]
        runs = [(n, w) for n, w in runs if w > 0]
        smaller = [w for n, w in runs if n <= params]
        if smaller:
            return max(smaller), f"longest wall time of {system} so far at this size or smaller"
        if runs:
            return min(w for _, w in runs), f"shortest wall time of {system} so far at a larger size"
        return default, "--default-estimate-s"

    def ordered(self) -> list[dict]:
        """Results by model, size (parameters) and system (the order of :data:`SYSTEMS`)."""

        def key(r: dict):
            base = base_system(r["system"])
            rank = SYSTEMS.index(base) if base in SYSTEMS else len(SYSTEMS)
            return family(r["size"]) != "gpt", num_params(r["size"]), rank, r["system"]

        return sorted(self.results.values(), key=key)

    def write(self) -> None:
        results = self.ordered()
        _write_atomic(self.out / "peers.json", json.dumps(results, indent=1))
        _write_atomic(self.out / "peers.md", markdown(results))


def _write_atomic(path: Path, text: str) -> None:
    """A kill in the middle leaves the old file, never half of the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def load_results(path: Path, protocol: dict | None = None) -> list[dict]:
    """The results of an earlier call; ``SystemExit`` when they were run with another protocol."""
    results = json.loads(Path(path).read_text())
    if not isinstance(results, list):
        raise SystemExit(f"{path}: expected a list of results (a peers.json)")
    for r in results if protocol else ():
        differ = {k: (r[k], protocol[k]) for k in PROTOCOL_KEYS if k in r and r[k] != protocol[k]}
        if differ:
            raise SystemExit(f"{path}: {r['size']} {r['system']} was run with other settings "
                             f"(recorded, now): {differ}; resume with the same settings")
    return results


# ------------------------------------------------------------------------------------------ the parent


class Interrupted(Exception):
    """SIGTERM (or SIGINT) reached the parent: the run in progress is stopped and recorded."""


def _on_signal(signum, _frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


_PRCTL = getattr(ctypes.CDLL(None), "prctl", None)  # Linux only


def _die_with_parent() -> None:
    """In the child before exec: be killed when the parent dies (a parent killed at a time limit
    must not leave a training process holding the GPU)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _kill(proc: subprocess.Popen) -> tuple[str, str]:
    """Kill the run's process group (it was started in a session of its own), reap it, and return
    what it had written (stdout, stderr)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.communicate()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def run_command(size: str, system: str, args) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one run: this script with ``--run``, or under ``--dp N``
    the same started by torchrun (``python -m torch.distributed.run --standalone --nproc_per_node N``),
    one process per GPU, each with ``OMP_NUM_THREADS`` its share of the cores unless set (torchrun
    would give each one thread, which starves a CPU optimizer)."""
    script = str(Path(__file__).resolve())
    cmd = ["--run", size, system, "--steps", str(args.steps),
           "--stream-steps", str(args.stream_steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--seq", str(args.seq), "--cap-gib", str(args.cap_gib), "--device", args.device,
           "--accumulate", str(args.accumulate), "--clip", str(args.clip), "--out", str(args.out)]
    env = dict(os.environ)
    if system in peer_configs.DEEPSPEED_SYSTEMS and env.get("TORCH_CUDA_ARCH_LIST"):  # its JIT builds (deepcompile)
        env["TORCH_CUDA_ARCH_LIST"] = peer_configs.jit_arch_list(env["TORCH_CUDA_ARCH_LIST"])
    if not args.dp:
        return [sys.executable, script, *cmd], env
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.dp)))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.dp}"]
    # "--": torchrun's own parser would refuse --run as an ambiguous prefix of its --run-path
    return [*launcher, script, "--", *cmd, "--dp", str(args.dp)], env


def _spawn(size: str, system: str, args, timeout: float) -> tuple[dict, bool, float]:
    """Run one (size, system) in a child process: (result, timed out, wall seconds). Interruptions
    (:class:`Interrupted`, ``KeyboardInterrupt``) kill the child and propagate."""
    cmd, env = run_command(size, system, args)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True, preexec_fn=_die_with_parent)  # noqa: PLW1509 no threads here
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        stdout, stderr = _kill(proc)
    except BaseException:
        _kill(proc)
        raise
    wall = time.monotonic() - start
    log_dir = args.out / "logs"
    log_dir.mkdir(exist_ok=True)
    (log_dir / f"{_slug(size)}__{_slug(system)}.log").write_text(
        f"$ {shlex.join(cmd)}\n# exit {proc.returncode}, {wall:.1f} s\n--- stdout\n{stdout[-100_000:]}"
        f"\n--- stderr\n{stderr[-100_000:]}"
    )
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT ") :]), timed_out, wall
    rc = proc.returncode
    how = f"killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit {rc}"
    tail = stderr.strip().splitlines()[-1:] or stdout.strip().splitlines()[-1:] or ["no output"]
    return {"status": "crash", "reason": f"{how}: {tail[0][:300]}"}, timed_out, wall


def _preflight(record: dict, args, ledger: Ledger, deadline: float | None) -> float | None:
    """The timeout of the run ``record`` is for, or None after recording in it why it does not start:
    ``skipped_host_ram`` (an offloading peer whose host RAM estimate exceeds what is available) or
    ``not_run`` (less time left before ``deadline`` than the run is estimated to take)."""
    size, system = record["size"], record["system"]
    if system == "zenflow" and args.accumulate > 1:
        record.update(status="not_applicable", reason="zenflow sets gradient_accumulation_steps to its update_interval "
                                                      "(deepspeed/runtime/zenflow/engine.py)")
        return None
    need = None if args.no_host_ram_check else host_bytes_needed(system, size, args.dp or 1)
    if need is not None:
        available, source = host_bytes_available()
        record.update(host_needed_bytes=need, host_available_bytes=available)
        if need > available:
            reason = (f"estimated host RAM {need / 2**30:.1f} GiB > {source} {available / 2**30:.1f} GiB "
                      "(an estimate, not a measured failure)")
            record.update(status="skipped_host_ram", reason=reason)
            return None
    if deadline is None:
        return float(args.timeout)
    remaining = deadline - time.monotonic() - RESERVE_S
    estimate, basis = ledger.estimate_s(system, size, args.default_estimate_s)
    if remaining < estimate:
        record.update(status="not_run", reason=f"deadline: {max(remaining, 0):.0f} s left < {estimate:.0f} s "
                                               f"estimated ({basis})")
        return None
    return min(float(args.timeout), remaining)


def run_all(args) -> int:
    """The parent: every (size, system) of the call, size by size; returns the exit status."""
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s if args.deadline_s is not None else None
    protocol = {k: getattr(args, k) for k in PROTOCOL_KEYS}
    previous = load_results(args.resume, protocol) if args.resume else []
    ledger = Ledger(args.out, previous, force_host_ram=args.no_host_ram_check)
    systems = system_names(args.systems, args.plan, args.offload)
    if args.resume:
        print(f"{len(previous)} results resumed from {args.resume}")
    pending: set[str] = set()  # systems with a size left to a later call: their larger sizes wait
    interrupted = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    try:
        for size in args.sizes:
            for system in systems:
                if ledger.done(size, system) or (args.ladder and (system in pending or ledger.stopped(size, system))):
                    continue
                record = {"size": size, "system": system, "model": family(size), "params": num_params(size),
                          "exact": peer_configs.exact(base_system(system)), **protocol}
                if base_system(system) == "protrain_plan":
                    record["plan"] = _PLAN_SYSTEM.match(system).group(1)
                if args.host_ram_gib:
                    record["host_ram_cap_gib"] = args.host_ram_gib
                timeout = _preflight(record, args, ledger, deadline)
                if timeout is None:  # recorded as skipped_host_ram or not_run
                    if record["status"] == "not_run":
                        pending.add(system)
                    ledger.add(record)
                    print(_row(record), flush=True)
                    continue
                record.update(start_s=round(time.monotonic() - t0, 2),
                              started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
                try:
                    result, timed_out, wall = _spawn(size, system, args, timeout)
                except (Interrupted, KeyboardInterrupt) as e:
                    interrupted = str(e) or type(e).__name__
                    wall = time.monotonic() - t0 - record["start_s"]
                    record.update(status="not_run", reason=f"interrupted ({interrupted}) after {wall:.0f} s",
                                  cut_off_after_s=wall)
                    ledger.add(record)
                    raise
                record.update(result, wall_s=round(wall, 2))
                if timed_out and timeout < args.timeout:  # the deadline's cut, not the run's own limit
                    record.update(status="not_run", reason=f"cut off at the deadline after {wall:.0f} s",
                                  cut_off_after_s=record.pop("wall_s"))
                    pending.add(system)
                elif timed_out:
                    record.update(status="timeout", reason=f"over {args.timeout} s")
                ledger.add(record)
                print(_row(record), flush=True)
    except (Interrupted, KeyboardInterrupt) as e:
        interrupted = interrupted or str(e) or type(e).__name__
        print(f"\ninterrupted ({interrupted}): results so far are in {args.out / 'peers.json'}", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
    ledger.write()
    results = ledger.ordered()
    print("\n" + markdown(results))
    left = [(size, system) for size in args.sizes for system in systems
            if not ledger.done(size, system) and not (args.ladder and ledger.stopped(size, system))]
    print(f"this call: {time.monotonic() - t0:.0f} s; up to {len(left)} run(s) left to a later call")
    print("resume with:\n  " + resume_command(args), flush=True)
    if interrupted is None:
        plot(results, args.out)
    return 130 if interrupted else 0


def resume_command(args, argv: list[str] | None = None) -> str:
    """This call's command line with ``--resume OUT/peers.json`` (any earlier ``--resume`` dropped)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--resume":
            skip = True
        elif not token.startswith("--resume="):
            kept.append(token)
    exe = "python3" if shutil.which("python3") == sys.executable else sys.executable
    script = os.path.relpath(Path(__file__).resolve(), Path.cwd()) if Path.cwd() == ROOT else __file__
    env_out = os.environ.get("OUT")
    tokens = [exe, script, *kept, "--resume", str(args.out / "peers.json")]
    text = " ".join(_quote(t, env_out) for t in tokens)
    if env_out and Path(env_out).resolve() in (args.out.resolve(), *args.out.resolve().parents):
        text += ("\n  ($OUT is new on every device call: carry this call's peers.json into the working "
                 "tree and give that path to --resume)")
    return text


def _quote(token: str, env_out: str | None) -> str:
    if env_out and token.startswith(env_out.rstrip("/")):
        return '"$OUT"' + shlex.quote(token[len(env_out.rstrip("/")) :]) if token != env_out else '"$OUT"'
    return shlex.quote(token)


# ------------------------------------------------------------------------------------------- reporting


def _tokens(r: dict) -> str:
    t = r["tokens_per_s"]
    return f"{t / 1e3:.1f}k" if t >= 1e3 else f"{t:.0f}"


def _row(r: dict) -> str:
    wall = f" [{r['wall_s']:.0f} s]" if r.get("wall_s") else ""
    if r["status"] != "ok":
        return f"{r['size']:>9} {r['system']:>14}: {r['status']} ({r.get('reason', '')[:140]}){wall}"
    peak = r.get("peak_allocated_bytes")
    peak_text = f", peak {peak / 2**30:.2f} GiB" if peak else ""
    bound = r.get("compute_bound_tok_s")
    bound_text = f" ({100 * r['tokens_per_s'] / bound:.0f}% of the compute bound, {bound / 1e3:.1f}k)" if bound else ""
    return (f"{r['size']:>9} {r['system']:>14}: {_tokens(r):>7} tok/s{bound_text}, "
            f"{1000 * r['step_s']:.1f} ms, MFU {100 * r['mfu']:.1f}%{peak_text}, loss {r['loss']:.3f}{wall}")


_CELL = {"skipped_host_ram": "host RAM (est.)", "not_run": "not run", "not_applicable": "n/a"}


def markdown(results: list[dict]) -> str:
    """Tokens/s table (sizes x systems), what its cells mean, and a detail table."""
    sizes = list(dict.fromkeys(r["size"] for r in results))
    systems = list(dict.fromkeys(r["system"] for r in results))
    cell = {(r["size"], r["system"]): r for r in results}
    p = results[0] if results else {}

    def fmt(r: dict | None) -> str:
        if r is None:
            return "–"
        return _tokens(r) if r["status"] == "ok" else _CELL.get(r["status"], r["status"])

    k, world = p.get("accumulate", 1), p.get("world_size", 1)
    name = "B24-L" if k == PROTOCOLS["B24-L"] else "B24" if k == 1 else f"B24, {k} micro-batches a step"
    title = (f"tokens/s, {name} (batch {p.get('batch')} x {p.get('seq')}"
             + (f" x {k} micro-batches accumulated per optimizer step" if k > 1 else "")
             + (f", data-parallel over {world} GPUs (tokens of every rank)" if world > 1 else "")
             + (f", gradients clipped to {p['clip']:g}" if p.get("clip") else "")
             + f", cap {p.get('cap_gib', 0):g} GiB, {p.get('steps')} timed steps after {p.get('warmup')} warm-up, "
               f"{p.get('device')})")
    lines = [title, "", "| model | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    lines += [f"| {s} | " + " | ".join(fmt(cell.get((s, y))) for y in systems) + " |" for s in sizes]
    legend = ("OOM / crash / timeout: the run failed (reasons below). host RAM (est.): not run because the "
              "estimated host RAM of the offloading peer exceeded the memory available (bench/peers.py, "
              "HOST_BYTES_PER_PARAM): an estimate, not a measured failure. not run: left to a later call "
              "(--resume). –: not attempted (the ladder stopped at a smaller size). n/a: the system does not run "
              "this protocol (reason below). exact: the system's update is AdamW's, so its loss is comparable "
              "(no: " + "; ".join(f"{k} {v}" for k, v in peer_configs.INEXACT.items()) + "). With --dp, peaks "
              "and exposed collective seconds are the highest rank's (each rank's in peers.json).")
    header = ("| model | system | status | tok/s | step ms | MFU | peak alloc GiB | predicted GiB (err) "
              "| peak reserved GiB | swapped GiB | host RAM GiB | loss | exact | exposed coll. ms | wall s "
              "| first step s | launch to last step s |")
    lines += ["", legend, "", header, "|---|" + "---|" * 16]
    lines += ["| " + " | ".join(_detail(r)) + " |" for r in results]
    lines += _overlap_table(results)
    return "\n".join(lines) + "\n"


def _overlap_table(results: list[dict]) -> list[str]:
    """Where the step time of the chunked runs goes: medians over the timed steps of GPU forward,
    backward and optimizer time and of the CPU optimizer's busy time, against the step time."""
    rows = [r for r in results if r.get("breakdown") and r["status"] == "ok"]
    if not rows:
        return []
    lines = ["", "Overlap of the chunked runs (medians over the timed steps, ms): forward, backward and the GPU "
             "optimizer are CUDA-event times; the CPU optimizer is its worker's busy time in the step; serial "
             "sum = forward + backward + CPU optimizer.", "",
             "| model | system | forward | backward | GPU optimizer | CPU optimizer | serial sum | step | "
             "host B/param |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        timed = r["breakdown"][-r["steps"]:]

        def med(key: str) -> float:
            return 1000 * statistics.median(b[key] for b in timed)

        serial = med("forward_s") + med("backward_s") + med("cpu_optimizer_busy_s")
        per_param = r.get("offload", {}).get("host_bytes_per_param")
        host = f"{per_param:.2f}" if per_param else "–"  # nothing kept on the host: the cell, not the row
        lines.append(f"| {r['size']} | {r['system']} | {med('forward_s'):.0f} | {med('backward_s'):.0f} | "
                     f"{med('gpu_optimizer_s'):.0f} | {med('cpu_optimizer_busy_s'):.0f} | {serial:.0f} | "
                     f"{1000 * r['step_s']:.0f} | {host} |")
    return lines


def _detail(r: dict) -> list[str]:
    ok = r["status"] == "ok"

    def gib(key: str) -> str:
        return f"{r[key] / 2**30:.2f}" if r.get(key) else "–"

    def sec(key: str) -> str:
        return f"{r[key]:.1f}" if r.get(key) is not None else "–"

    return [
        r["size"],
        r["system"],
        r["status"] if ok else f"{_CELL.get(r['status'], r['status'])}: {r.get('reason', '')[:120]}",
        _tokens(r) if ok else "–",
        f"{1000 * r['step_s']:.1f}" if ok else "–",
        f"{100 * r['mfu']:.1f}%" if ok else "–",
        gib("peak_allocated_bytes"),
        _predicted(r),
        gib("peak_reserved_bytes"),
        gib("swapped_bytes"),
        gib("host_peak_bytes"),
        f"{r['loss']:.3f}" if ok else "–",
        {True: "yes", False: "no"}.get(r.get("exact", peer_configs.exact(base_system(r["system"])))),
        f"{1000 * r['exposed_collective_s']:.0f}" if r.get("exposed_collective_s") is not None else "–",
        sec("wall_s"),
        sec("first_step_s"),
        sec("launch_to_last_step_s"),
    ]


def _predicted(r: dict) -> str:
    """protrain's predicted peak and its error against the measured peak allocated."""
    pred, meas = r.get("predicted_peak_bytes"), r.get("peak_allocated_bytes")
    if not pred:
        return "–"
    err = f" ({100 * (pred - meas) / meas:+.1f}%)" if meas and r["status"] == "ok" else ""
    return f"{pred / 2**30:.2f}{err}"


def plot(results: list[dict], out: Path) -> None:
    """PNG plots (matplotlib, benchmark-only; skipped where it is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found: no PNG plots")
        return
    lines = list(dict.fromkeys((r["system"], family(r["size"])) for r in results))
    fig, ax = plt.subplots(figsize=(8, 5))
    for system, fam in lines:
        pts = sorted((num_params(r["size"]) / 1e9, r["tokens_per_s"]) for r in results
                     if r["system"] == system and family(r["size"]) == fam and r["status"] == "ok")
        if pts:
            label = system if fam == "gpt" else f"{system} ({fam})"
            ax.plot(*zip(*pts), marker="o" if fam == "gpt" else "s", label=label)
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("tokens/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "peers_throughput.png", dpi=120)
    fig, ax = plt.subplots(figsize=(8, 4))
    largest = {}
    for system, fam in lines:
        ok = [num_params(r["size"]) / 1e9 for r in results
              if r["system"] == system and family(r["size"]) == fam and r["status"] == "ok"]
        largest[system if fam == "gpt" else f"{system} ({fam})"] = max(ok, default=0.0)
    ax.barh(list(largest), list(largest.values()))
    ax.set_xlabel("largest size that trained (billions of parameters)")
    fig.tight_layout()
    fig.savefig(out / "peers_largest.png", dpi=120)
    plt.close("all")


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=tuple(MODELS),
                        help="gpt: the GPT of examples/gpt.py at --sizes; llama1b: Hugging Face Llama, 1.1B "
                             "(size llama1.1B); llama_tiny: a tiny Llama for CPU dry runs")
    parser.add_argument("--sizes", nargs="+", help="GPT presets of examples/gpt.py (default 350M)")
    parser.add_argument("--systems", nargs="+", default=[s for s in SYSTEMS if s != "protrain_offload"],
                        choices=SYSTEMS, help="default: all but protrain_offload (name it to run it)")
    parser.add_argument("--plan", nargs="+", default=["checkpoint=all"], metavar="SPEC",
                        help="protrain_plan's plans, one system each: 'swap=N,checkpoint=M' (counts for "
                             "protrain_fx.plan.interleaved; 'all' = every block the other leaves) or the "
                             "path of a plan .json (default: checkpoint=all)")
    parser.add_argument("--offload", nargs="+", default=["buffer=3,checkpoint=all"], metavar="SPEC",
                        help="protrain_offload's settings, one system each: 'persist=P,buffer=B' and an "
                             "optional activation plan as --plan (default: buffer=3,checkpoint=all)")
    parser.add_argument("--host-ram-gib", type=float,
                        help="emulate a host with this much free RAM (GiB): the offloading peers' host RAM "
                             "check and protrain_fx's chunk store use it instead of MemAvailable")
    parser.add_argument("--ladder", action="store_true", help="per system, stop at its first failing size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stream-steps", type=int, default=0,
                        help="after the timed steps, this many more with no device sync between them "
                             "(stream_step_s: their wall time over their count, one sync at each end)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps (at least 1; the first compiles)")
    parser.add_argument("--protocol", choices=tuple(PROTOCOLS),
                        help="B24: one micro-batch a step; B24-L: 8 micro-batches of --batch x --seq accumulated "
                             "per optimizer step (sets --accumulate)")
    parser.add_argument("--accumulate", type=int, default=None,
                        help="micro-batches per optimizer step (default 1, or --protocol's)")
    parser.add_argument("--dp", type=int, default=0, metavar="N",
                        help="data-parallel over N GPUs of this host: each run starts under torchrun with N "
                             f"processes; systems {', '.join(DATA_PARALLEL_SYSTEMS)}")
    parser.add_argument("--clip", type=float, default=0.0, metavar="MAX_NORM",
                        help="clip the gradients' global norm to MAX_NORM before each optimizer step, as each "
                             "system's users do (clip_grad_norm_; DeepSpeed: gradient_clipping); 0: no clipping")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--deadline-s", type=float, help="seconds for this whole call (see the module docstring)")
    parser.add_argument("--default-estimate-s", type=float, default=90.0,
                        help="with --deadline-s: expected seconds of a run of a system not yet timed")
    parser.add_argument("--resume", type=Path, metavar="FILE.json", help="continue from an earlier call's peers.json")
    parser.add_argument("--no-host-ram-check", action="store_true",
                        help="run the offloading peers even where their host RAM estimate exceeds what is free")
    parser.add_argument("--report", type=Path, metavar="FILE.json",
                        help="only write peers.md and the plots of a peers.json into --out")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--run", nargs=2, metavar=("SIZE", "SYSTEM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    protocol_k = PROTOCOLS[args.protocol] if args.protocol else None
    if protocol_k and args.accumulate not in (None, protocol_k):
        parser.error(f"--protocol {args.protocol} accumulates {protocol_k} micro-batches, not --accumulate {args.accumulate}")
    args.accumulate = args.accumulate or protocol_k or 1
    if args.accumulate < 1 or args.dp < 0 or args.clip < 0:
        parser.error("--accumulate must be at least 1, --dp and --clip at least 0")
    args.world_size = args.dp or 1
    _check_data_parallel(parser, args)
    if args.model != "gpt":
        if args.sizes:
            parser.error(f"--sizes is for --model gpt; --model {args.model} trains {MODELS[args.model]}")
        args.sizes = [MODELS[args.model]]
    args.sizes = args.sizes or ["350M"]
    from examples.gpt import SIZES

    unknown = [s for s in args.sizes if s not in SIZES and s not in LLAMA_SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; GPT presets: {', '.join(SIZES)}; Llama: {', '.join(LLAMA_SIZES)}")
    for spec in args.offload:
        try:
            parse_offload_spec(spec)
        except ValueError as e:
            parser.error(str(e))
    if args.host_ram_gib:
        os.environ[HOST_RAM_ENV] = str(int(args.host_ram_gib * 2**30))  # the runs inherit it
    for spec in args.plan:
        try:
            parsed = parse_plan_spec(spec)
        except ValueError as e:
            parser.error(str(e))
        if isinstance(parsed, Path) and not parsed.is_file():
            parser.error(f"--plan {spec}: no such file {parsed}")
    return args


def _check_data_parallel(parser: argparse.ArgumentParser, args) -> None:
    """``--dp``: only systems that train data-parallel; the parent runs without torchrun (it starts
    torchrun for each run), a run under it (``--run``) in a torchrun of ``--dp`` processes."""
    world = os.environ.get("WORLD_SIZE") if "LOCAL_RANK" in os.environ else None
    if args.run:
        if args.dp and world != str(args.dp):
            parser.error(f"--run with --dp {args.dp}: start it with torchrun --nproc_per_node={args.dp} (WORLD_SIZE "
                         f"is {world})")
        return
    if world is not None:
        parser.error("run bench/peers.py itself without torchrun: --dp N starts torchrun with N processes for each "
                     "run (torchrun --nproc_per_node=N bench/peers.py -- --run SIZE SYSTEM --dp N runs one)")
    if args.dp:
        names = system_names(args.systems, args.plan, args.offload)
        other = [s for s in names if base_system(s) not in DATA_PARALLEL_SYSTEMS]
        if other:
            parser.error(f"--dp: {other} would train one model per rank; data-parallel systems: "
                         f"{', '.join(DATA_PARALLEL_SYSTEMS)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        result = run_one(*args.run, steps=args.steps, stream_steps=args.stream_steps, warmup=args.warmup,
                         batch=args.batch, seq=args.seq, cap_gib=args.cap_gib, device=args.device,
                         accumulate=args.accumulate, clip=args.clip)
        if _torchrun_ranks()[1] in (None, 0):  # under torchrun, rank 0 speaks for every rank
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.report:
        results = Ledger(args.out, load_results(args.report)).ordered()
        (args.out / "peers.md").write_text(markdown(results))
        plot(results, args.out)
        print(markdown(results))
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
