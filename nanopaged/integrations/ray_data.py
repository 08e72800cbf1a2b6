"""Data-parallel batch inference on Ray Data: one LLM per actor (a replica), rows spread over them.

    import ray
    from nanopaged.integrations.ray_data import add_generations, io_args

    ds = ray.data.read_json("prompts.jsonl", **io_args(ray.data.read_json))
    ds = add_generations(ds, model="/models/Qwen3-8B", concurrency=4, tensor_parallel_size=2,
                         sampling_params=dict(temperature=0, max_tokens=256))
    ds.write_parquet("out/", **io_args(ray.data.Dataset.write_parquet))

Each replica reserves what it runs: on GPU nodes its tensor_parallel_size GPUs and a fraction of
a CPU; on CPU its torch threads (num_threads). add_generations checks the replicas against the
cluster before anything runs and raises ClusterTooSmall when they cannot all be placed. Replicas
may hold every CPU, so reads and writes reserve none (io_args): they only move rows, and one
that waits for a CPU waits forever.

Needs the `ray` extra: pip install "nanopaged[ray]".
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nanopaged.llm import LLM
from nanopaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    import ray.data

logger = logging.getLogger(__name__)

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "finish_reason")
# A GPU replica's process mostly waits on its GPUs; a whole CPU each would let the CPU count,
# not the GPUs, cap the replicas on nodes with few CPUs per GPU.
GPU_REPLICA_CPUS = 0.5
# Ray Data deprecated map_batches(concurrency=) for compute=ActorPoolStrategy(...) in 2.51;
# before that it was the other way round.
COMPUTE_API_RAY_VERSION = (2, 51)


class ClusterTooSmall(ValueError):
    """The requested replicas do not fit the Ray cluster's nodes."""


class NanopagedPredictor:
    """A Ray Data map_batches class: reads a prompt column and adds generated_text,
    generated_token_ids and finish_reason (of the first completion).

    A prompt is a chat (a list of {"role", "content"} messages, rendered with the model's chat
    template) or text, sent as a raw completion; chat=True turns text into one user message, as
    instruct models expect. num_threads sets the replica's torch threads (CPU). replica_column
    names a column that gets "host:pid" of the replica that served each row.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        prompt_column: str = "prompt",
        chat: bool = False,
        num_threads: int | None = None,
        replica_column: str | None = None,
        **llm_kwargs: Any,
    ) -> None:
        """llm_kwargs go to LLM (tensor_parallel_size, dtype, max_model_len, ...)."""
        if not isinstance(chat, bool):
            raise TypeError(f"chat must be a bool, got {type(chat).__name__}")
        _check_count("num_threads", num_threads, optional=True)
        if replica_column is not None and not isinstance(replica_column, str):
            raise TypeError(f"replica_column must be a str, got {type(replica_column).__name__}")
        if isinstance(sampling_params, Mapping):
            sampling_params = SamplingParams(**sampling_params)
        self.sampling_params = sampling_params or SamplingParams()
        self.prompt_column = prompt_column
        self.chat = chat
        self.replica_column = replica_column
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        self.llm = LLM(model, **llm_kwargs)

    def __call__(self, batch):
        """batch: a dict of numpy arrays (Ray's default batch format) or a pandas DataFrame."""
        if self.prompt_column not in batch:
            raise ValueError(
                f"the batch has no {self.prompt_column!r} column (columns: {list(batch)}); "
                "pass prompt_column=..."
            )
        prompts = [_as_prompt(p, i) for i, p in enumerate(batch[self.prompt_column])]
        if self.chat:
            prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p
                       for p in prompts]  # fmt: skip
        chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        outputs: list = [None] * len(prompts)
        params = self.sampling_params
        if texts:
            outs = self.llm.generate([prompts[i] for i in texts], params, use_tqdm=False)
            for i, o in zip(texts, outs):
                outputs[i] = o.outputs[0]
        if chats:
            outs = self.llm.chat([prompts[i] for i in chats], params, use_tqdm=False)
            for i, o in zip(chats, outs):
                outputs[i] = o.outputs[0]
        columns = {
            "generated_text": [c.text for c in outputs],
            "generated_token_ids": [list(c.token_ids) for c in outputs],
            "finish_reason": [c.finish_reason for c in outputs],
        }
        if self.replica_column is not None:
            columns[self.replica_column] = [self.replica] * len(outputs)
        if hasattr(batch, "assign"):  # pandas
            return batch.assign(**columns)
        out = dict(batch)
        for name, values in columns.items():
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            out[name] = arr
        return out

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def add_generations(
    ds: ray.data.Dataset,
    model: str | os.PathLike | None = None,
    *,
    concurrency: int = 1,
    tensor_parallel_size: int = 1,
    num_threads: int | None = None,
    batch_size: int = 256,
    wait_for_nodes: bool = False,
    **predictor_kwargs: Any,
) -> ray.data.Dataset:
    """ds.map_batches(NanopagedPredictor) on `concurrency` replicas that fit the cluster.

    On GPU nodes a replica reserves tensor_parallel_size GPUs and GPU_REPLICA_CPUS; on CPU its
    num_threads torch threads per rank (default: the most that lets every replica fit). Raises
    ClusterTooSmall when the cluster's nodes cannot hold `concurrency` replicas; with
    wait_for_nodes=True (an autoscaling cluster) it logs that it waits for nodes instead.
    predictor_kwargs go to NanopagedPredictor (sampling_params, chat, prompt_column, LLM's).
    """
    import ray

    _check_count("concurrency", concurrency)
    _check_count("tensor_parallel_size", tensor_parallel_size)
    _check_count("num_threads", num_threads, optional=True)
    _check_count("batch_size", batch_size)
    if not isinstance(wait_for_nodes, bool):
        raise TypeError(f"wait_for_nodes must be a bool, got {type(wait_for_nodes).__name__}")
    if not ray.is_initialized():
        ray.init()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive", True)]
    device = str(predictor_kwargs.get("device", "auto"))
    on_gpus = device.startswith("cuda") or (
        device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
    )
    if on_gpus:
        per_replica = {"CPU": GPU_REPLICA_CPUS, "GPU": float(tensor_parallel_size)}
    else:
        if num_threads is None:
            num_threads = _threads_to_fit(nodes, concurrency, tensor_parallel_size)
        per_replica = {"CPU": float(num_threads * tensor_parallel_size)}
        predictor_kwargs["num_threads"] = num_threads
    fit = replicas_that_fit(nodes, per_replica)
    if fit < concurrency:
        cluster = {name: ray.cluster_resources().get(name, 0) for name in per_replica}
        message = (
            f"concurrency={concurrency} replicas of {_resources(per_replica)} each "
            f"({_resources({k: v * concurrency for k, v in per_replica.items()})} in all) do "
            f"not fit Ray's cluster of {_resources(cluster)} on "
            f"{len(nodes)} node(s): at most {fit} fit"
        )
        if not wait_for_nodes:
            hint = "num_threads" if not on_gpus else "tensor_parallel_size"
            raise ClusterTooSmall(f"{message}; lower concurrency or {hint}, or add nodes")
        logger.warning("%s now; waiting for the autoscaler to add nodes", message)
    return ds.map_batches(
        NanopagedPredictor,
        fn_constructor_kwargs=dict(
            model=model, tensor_parallel_size=tensor_parallel_size, **predictor_kwargs
        ),
        batch_size=batch_size,
        num_cpus=per_replica["CPU"],
        num_gpus=per_replica.get("GPU", 0),
        **actor_pool_args(concurrency, _ray_version(ray.__version__)),
    )


def replicas_that_fit(
    nodes: Sequence[Mapping[str, float]], per_replica: Mapping[str, float]
) -> int:
    """How many replicas the nodes hold: a replica's resources all come from one node."""
    return sum(
        min(int(node.get(name, 0) // need) for name, need in per_replica.items() if need > 0)
        for node in nodes
    )


def actor_pool_args(concurrency: int, ray_version: tuple[int, int]) -> dict[str, Any]:
    """map_batches' arguments for a fixed pool of `concurrency` actors, in this Ray's API."""
    if ray_version >= COMPUTE_API_RAY_VERSION:
        from ray.data import ActorPoolStrategy

        return {"compute": ActorPoolStrategy(size=concurrency)}
    return {"concurrency": concurrency}


def io_args(read_or_write: Callable[..., Any]) -> dict[str, Any]:
    """Keyword arguments that make a Ray Data read or write (ray.data.read_json,
    Dataset.write_parquet, ...) reserve no CPU, in the form that function takes."""
    # Newer Ray's reads take num_cpus= and deprecate ray_remote_args= (gone in 2.64); older
    # reads, and writes, take only ray_remote_args.
    if "num_cpus" in inspect.signature(read_or_write).parameters:
        return {"num_cpus": 0}
    return {"ray_remote_args": {"num_cpus": 0}}


def _threads_to_fit(
    nodes: Sequence[Mapping[str, float]], concurrency: int, tensor_parallel_size: int
) -> int:
    """The most torch threads per rank with which `concurrency` CPU replicas still fit (1 when
    none does, so the fit check reports it)."""
    most = max((int(n.get("CPU", 0)) for n in nodes), default=0) // tensor_parallel_size
    for threads in range(most, 1, -1):
        if replicas_that_fit(nodes, {"CPU": threads * tensor_parallel_size}) >= concurrency:
            return threads
    return 1


def _ray_version(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def _resources(amounts: Mapping[str, float]) -> str:
    """{"CPU": 2.0, "GPU": 1.0} -> '2 CPU, 1 GPU'."""
    return ", ".join(f"{amount:g} {name}" for name, amount in amounts.items())


def _check_count(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an int >= 1 or None" if optional else "an int >= 1"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _as_prompt(value: Any, index: int) -> str | list[dict[str, str]]:
    """A row's prompt: text as is, a chat (list of messages, as Arrow hands it back) as a list
    of plain dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, (Sequence, np.ndarray)) and all(isinstance(m, Mapping) for m in value):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    raise TypeError(
        f"prompt of row {index} must be a str or a list of {{'role', 'content'}} messages, "
        f"got {type(value).__name__}"
    )
