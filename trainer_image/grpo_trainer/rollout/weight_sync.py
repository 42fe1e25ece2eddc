"""CPU weight sync: safetensors in a shared directory, then vLLM's own `reload_weights`, behind TRL's protocol.

A LoRA run syncs its adapter alone (`training.lora.sync: adapter`): each version directory then holds the peft
adapter, and every rollout server loads it through `/v1/load_lora_adapter` under a versioned name
(`adapter_name`) that generation requests name as their model. TRL's own adapter sync reaches the one server its
client talks to (it falls back to merged weights when a server holds several replicas); here it goes to each
server in the pool, with each server's version kept as for whole weights.

vLLM ships no CPU weight-transfer engine (nccl, ipc, sparse_nccl, nccl_m2n, sharded_rdt are all GPU), so on CPU the
learner writes the streamed `(name, tensor)` pairs as a safetensors checkpoint into a directory the server can read
and asks every rollout server to reload from it through `POST /collective_rpc` (dev mode). Each sync goes to a fresh
version directory, renamed into place only when complete, so a server never reads a half-written checkpoint. A sync
that fails raises: generating with old weights while the learner believes otherwise would be silent off-policy
training.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import requests
import torch
from safetensors.torch import save_file

from ..contract.codes import WEIGHT_VERSION_PREFIX
from ..contract.config import RunConfig
from ..contract.rollout_pod import PROBE_TIMEOUT_S
from .server_set import ServerSet
from .sync_watchdog import DaemonCall

logger = logging.getLogger(__name__)

#: Tensors per safetensors shard are cut at this size, so a sync never holds more than one shard in extra memory.
SHARD_BYTES = 512 * 1024 * 1024
VERSION_PREFIX = WEIGHT_VERSION_PREFIX
#: While a sync waits for a ready rollout server, it says so once, then again after this long.
WAIT_LOG_INTERVAL_S = 30.0


class WeightSyncError(RuntimeError):
    pass


def gathered_parameters(
    named: Iterable[tuple[str, torch.Tensor]], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter whole on `device`, in `named`'s order, its gather finished before it is handed on.

    An FSDP2 parameter is a DTensor holding this rank's shard: `full_tensor()` all-gathers it, a collective every
    rank must enter in the same order, so every rank walks this iterator whole while only rank 0 sends. Waiting for
    the gather before yielding keeps the training group's collectives strictly ordered against whatever the sender
    does next (a vLLM NCCL group of its own, an HTTP call, a file write): a gather left queued on the device behind
    the sender's broadcasts is how the ranks deadlock. A shard offloaded to CPU (`learner.fsdp.cpuOffload`) is
    moved to the device first, where the process group gathers.
    """
    from torch.distributed.tensor import DTensor

    for name, param in named:
        if isinstance(param, DTensor):
            if param.device != device:
                param = param.to(device)
            full = param.full_tensor().detach()
            if full.is_cuda:
                torch.cuda.current_stream(full.device).synchronize()
        else:
            full = param.detach()
        yield name, full if full.device == device else full.to(device)


def gathered_before_sending(
    named: Iterable[tuple[str, torch.Tensor]], device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter gathered (into CPU memory) before the first is handed on; each then moves to `device` as
    the sender takes it.

    For a sender that consumes on a thread of its own while it talks to other processes (TRL's NCCL client
    broadcasts to vLLM from a daemon thread during an HTTP call): rank 0's gathers then all finish on the caller's
    thread, in the order the other ranks run them, before any byte goes to vLLM. The whole model is held in CPU
    memory for the sync's duration, the device holds one parameter at a time.
    """
    held = [(name, tensor.to("cpu")) for name, tensor in gathered_parameters(named, device)]  # now, not lazily
    return ((name, tensor.to(device)) for name, tensor in held)


#: The name the rollout servers serve the trained adapter under, with its version (`adapter_name`).
ADAPTER_NAME = "policy"
#: peft's adapter config file: a version directory holding it is an adapter, not whole weights.
ADAPTER_CONFIG_FILE = "adapter_config.json"


#: The server's answer to a path it does not have (FastAPI's): vLLM adds `/v1/load_lora_adapter` only when it may
#: load adapters at runtime.
ROUTE_NOT_FOUND = re.compile(r'answered 404: \{"detail": ?"Not Found"\}')


def adapter_name(version: int) -> str:
    """What generation requests name as their model to be served adapter version `version`."""
    return f"{ADAPTER_NAME}-{VERSION_PREFIX}{version}"


def is_adapter(checkpoint: Path) -> bool:
    return (checkpoint / ADAPTER_CONFIG_FILE).is_file()


def directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


#: The sync step each server call belongs to, for a stall's message (the reload is three calls).
SYNC_STEPS = {
    "/pause": "pause",
    "/collective_rpc": "reload_weights",
    "/v1/load_lora_adapter": "load_lora_adapter",
    "/v1/unload_lora_adapter": "unload_lora_adapter",
    "/update_weight_version": "reload_weights",
    "/reset_prefix_cache": "reload_weights",
    "/resume": "resume",
}


#: The output embedding's name when a causal LM ties it to the input embedding (HF and vLLM spell both alike).
TIED_EMBEDDING_ALIASES = {"model.embed_tokens.weight": "lm_head.weight"}


def with_aliases(
    pairs: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Also emit each aliased tensor under its alias name.

    vLLM ties lm_head to embed_tokens by sharing one Parameter; `reload_weights` materialises a new tensor for
    embed_tokens and the tie is gone, so lm_head keeps serving the old output embedding (measured on the CPU server:
    after a sync with perturbed embeddings the greedy logprob stayed at -5.41 where the learner's model gave -0.0001).
    The learner streams a tied model's embedding once, so the output embedding is written out under its own name.
    """
    for name, tensor in pairs:
        yield name, tensor
        if name in aliases:
            yield aliases[name], tensor


def write_checkpoint(pairs: Iterable[tuple[str, torch.Tensor]], directory: Path, shard_bytes: int = SHARD_BYTES) -> int:
    """Write `pairs` as safetensors shards into `directory` (which must not exist yet). Returns the bytes written."""
    directory.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    shard_size = total = 0
    index = 0

    def flush() -> None:
        nonlocal shard, shard_size, index
        if shard:
            save_file(shard, str(directory / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            shard, shard_size, index = {}, 0, index + 1

    for name, tensor in pairs:
        # safetensors refuses views and shared storage (tied embeddings): store an owned, contiguous CPU copy.
        owned = tensor.detach().to("cpu").contiguous().clone()
        size = owned.numel() * owned.element_size()
        if shard and shard_size + size > shard_bytes:
            flush()
        shard[name] = owned
        shard_size += size
        total += size
    flush()
    if index == 0:
        raise WeightSyncError("the learner streamed no weights to sync")
    return total


class FilesystemWeightTransfer:
    """TRL's `WeightTransferProtocol` over a shared directory and vLLM's `reload_weights` (CPU rollout servers)."""

    def __init__(
        self, server_urls: list[str], directory: str | os.PathLike, *, timeout_s: float = 300.0,
        ready_timeout_s: float = 240.0, aliases: dict[str, str] | None = None, servers: ServerSet | None = None,
        pause_timeout_s: float = PROBE_TIMEOUT_S, adapter_window: int = 1,
    ):
        if not server_urls:
            raise ValueError("filesystem weight sync needs at least one rollout server URL")
        self.server_urls = [url.rstrip("/") for url in server_urls]
        # With a server set (the learner's supervision), a server that fails a sync leaves the pool instead of failing
        # the run, and is brought to the current version by `catch_up` before it is admitted again.
        self.servers = servers
        self._lock = threading.Lock()
        # Absolute: the path is resolved by the server process, whose working directory may differ.
        self.directory = Path(directory).resolve()
        self.timeout_s = timeout_s
        # `/pause?mode=keep` freezes requests and answers at once; a server that does not is hung, and waiting the
        # full timeout held every other (already paused) server too: 163 s once under `grporun local`.
        self.pause_timeout_s = pause_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.aliases = dict(aliases or {})
        # Adapter versions a request may still name (TRL's max_staleness + 1): each stays loaded on the servers, and
        # on disk for one sync more (vLLM reads an adapter's files lazily, and a missing one kills its engine).
        self.adapter_window = adapter_window
        # Set on SIGTERM (`stop_waiting`): the learner has the pod's grace period (120 s unless set) to checkpoint.
        self._stopping = threading.Event()
        self.version = 0
        self.sync_seconds: list[float] = []
        self.bytes_written = 0
        # The server calls under way, with when each began: what a stalled sync names (`waiting_on`).
        self._under_way: dict[int, tuple[str, str, float]] = {}
        self._writing_since: float | None = None

    # -- HTTP ---------------------------------------------------------------------------------------------------------
    def stop_waiting(self) -> None:
        """The learner is stopping (SIGTERM): a sync under way stops waiting on servers and returns, so the trainer
        reaches its checkpoint within the grace period. The weights are still written; a restarted learner loads
        every server before it takes traffic, so none is left behind. Called from the signal handler."""
        self._stopping.set()

    def waiting_on(self) -> str:
        """What the sync waits on now, for a stalled sync's message: each server call under way (server, call,
        step, for how long), or the weights' write, or nothing (the sync then waits in the ranks' barrier)."""
        now = time.monotonic()
        calls = sorted(self._under_way.copy().values(), key=lambda call: call[2])  # copy: the sync thread edits it
        if calls:
            return "; ".join(f"{url} did not answer {path} ({SYNC_STEPS.get(path, path)}) in {now - began:.0f}s"
                             for url, path, began in calls)
        writing_since = self._writing_since
        if writing_since is not None:
            return f"writing the weights to {self.directory} for {now - writing_since:.0f}s"
        return "no rollout server call under way (the sync waits in the ranks' barrier, or for a server to be ready)"

    def _post(self, url: str, path: str, *, timeout_s: float | None = None, **kwargs) -> requests.Response:
        timeout_s = timeout_s or self.timeout_s
        token = object()
        self._under_way[id(token)] = (url, path, time.monotonic())
        try:
            response = self._abandonable(lambda: requests.post(f"{url}{path}", timeout=timeout_s, **kwargs))
        except requests.Timeout as error:
            raise WeightSyncError(f"weight sync: POST {url}{path}: no answer within {timeout_s:.0f}s") from error
        except requests.RequestException as error:
            raise WeightSyncError(f"weight sync: POST {url}{path} failed: {error}") from error
        finally:
            del self._under_way[id(token)]
        if response is None:
            raise WeightSyncError(f"weight sync: POST {url}{path} left unanswered: the learner is stopping")
        if response.status_code != 200:
            raise WeightSyncError(
                f"weight sync: POST {url}{path} answered {response.status_code}: {response.text[:500]}"
            )
        return response

    def _abandonable(self, call):
        """`call()`'s result, or None once `stop_waiting` was called while it ran (left running on its thread until
        its timeout or the process ends)."""
        if self._stopping.is_set():
            return None
        running = DaemonCall(call, "grpo-weight-sync-http")
        while not running.join(0.2):
            if self._stopping.is_set():
                return None
        return running.result()

    def _reload(self, url: str, checkpoint: Path) -> None:
        response = self._post(
            url, "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}
        )
        # vLLM answers one result per worker; reload_weights returns None on success, a worker error is a 500 above.
        results = response.json().get("results") if response.content else None
        if not isinstance(results, list) or not results or any(result is not None for result in results):
            raise WeightSyncError(f"weight sync: {url} reload_weights gave an unexpected answer: {response.text[:500]}")
        self._post(url, "/update_weight_version", json={"new_version": checkpoint.name})
        # `pause(mode=keep)` keeps the prefix cache, whose blocks hold keys/values computed by the old weights; a
        # cached prompt would keep being served through them. The reset fails while frozen requests hold blocks:
        # those requests were generated by the previous policy anyway and TRL's staleness bound covers them.
        reset = self._post(url, "/reset_prefix_cache").json()
        if not reset.get("success", False):
            logger.info("weight sync: %s kept some prefix-cache blocks held by in-flight requests", url)

    # -- WeightTransferProtocol ---------------------------------------------------------------------------------------
    def init_weight_transfer(self) -> None:
        """Continue the version count from the directory, then wait for the servers (they start with the learner).

        Without a server set every server must answer /health; with one, the supervision admits servers as they
        come and the first sync waits for one (`_each`).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self.version = resume_version(self.directory)
        if self.servers is not None:
            return
        deadline = time.monotonic() + self.ready_timeout_s
        for url in self.server_urls:
            while True:
                try:
                    if requests.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"weight sync: rollout server {url} did not become healthy within {self.ready_timeout_s:.0f}s"
                    )
                time.sleep(1.0)

    def _each(self, action, what: str) -> list[str]:
        """Run `action(url)` on every server; with a server set, on the servers in the pool.

        With a server set a failure takes that server out of the pool (the supervision admits it again once it
        generates and has caught up), a server that is draining (it left `rollout.urls`) gets no step from the
        moment it leaves, and when no server is left the sync waits, bounded by `ready_timeout_s`, for
        one to come back (a single server being restarted) instead of failing the run.
        """
        if self.servers is None:
            for url in self.server_urls:
                try:
                    action(url)
                except WeightSyncError:
                    if self._stopping.is_set():
                        return []
                    raise
            return self.server_urls
        began = time.monotonic()
        deadline, said_at = began + self.ready_timeout_s, None
        while True:
            done = []
            for url in self.servers.ready_urls():
                if self._stopping.is_set():
                    break
                with self.servers.sync_step(url) as held:
                    if not held:
                        continue  # it left the run's set (or failed) since the list was taken: the sync goes on
                    try:
                        action(url)
                    except WeightSyncError as error:
                        logger.warning("weight sync: %s failed on %s; it leaves the pool until it catches up: %s",
                                       what, url, error)
                        self.servers.fail(url, str(error))
                    else:
                        done.append(url)
            if done or self._stopping.is_set():
                return done
            now = time.monotonic()
            if now > deadline:
                raise WeightSyncError(f"weight sync: {what}: no rollout server was ready within "
                                      f"{self.ready_timeout_s:.0f}s")
            if said_at is None or now - said_at >= WAIT_LOG_INTERVAL_S:  # a server's start takes minutes
                logger.warning("weight sync: %s waits for a rollout server to be ready (%.0f s so far, at most %.0f s)",
                               what, now - began, self.ready_timeout_s)
                said_at = now
            time.sleep(1.0)

    def pause(self) -> None:
        if self.servers is not None:
            self.servers.sync_started()
        self._each(lambda url: self._post(url, "/pause", params={"mode": "keep"}, timeout_s=self.pause_timeout_s),
                   "pause")

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        started = time.perf_counter()
        version = self.version + 1
        final = self.directory / f"{VERSION_PREFIX}{version}"
        staging = self.directory / f".{VERSION_PREFIX}{version}.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # left by a crashed run that reached the same version
        self._writing_since = time.monotonic()
        try:
            self.bytes_written = write_checkpoint(with_aliases(iterator, self.aliases), staging)
        finally:
            self._writing_since = None
        staging.rename(final)
        self.version = version  # from here a server being admitted catches up to this version
        targets = self._each(lambda url: self._load(url, final), "reload_weights")
        remove_other_versions(self.directory, keep=[final.name])
        elapsed = time.perf_counter() - started
        self.sync_seconds.append(elapsed)
        logger.info(
            "weight sync v%d: %.1f MB to %d server(s) in %.2fs", version, self.bytes_written / 1e6, len(targets),
            elapsed,
        )

    def _load(self, url: str, checkpoint: Path) -> None:
        with self._lock:  # one load per server at a time: the sync's and a catch-up's never interleave
            if is_adapter(checkpoint):
                self._load_adapter(url, checkpoint)
            else:
                self._reload(url, checkpoint)
        if self.servers is not None:
            self.servers.set_version(url, checkpoint.name)

    def _load_adapter(self, url: str, adapter: Path) -> None:
        """Load `adapter` (a version directory) on `url` under its versioned name. A fresh name per version: vLLM keys
        its prefix cache on the adapter's name, so no cache reset is needed. A name the server already holds may be
        another adapter's (an earlier learner of this run, or another run on a reused server): it is unloaded and
        this version's files loaded, so the name always serves what this learner trained (and the reload gets a new
        adapter id, which keeps the prefix cache from mixing the two)."""
        name = adapter_name(_version_of(adapter))
        request = {"lora_name": name, "lora_path": str(adapter), "load_inplace": False}
        try:
            self._post(url, "/v1/load_lora_adapter", json=request)
        except WeightSyncError as error:
            if ROUTE_NOT_FOUND.search(str(error)):
                raise WeightSyncError(
                    f"weight sync: {url} does not load LoRA adapters: it needs --enable-lora and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (the rollout entrypoint sets both for training.lora.sync: "
                    "adapter), or the run needs training.lora.sync: merged") from error
            if "has already been loaded" not in str(error):
                raise
            self._post(url, "/v1/unload_lora_adapter", json={"lora_name": name})
            self._post(url, "/v1/load_lora_adapter", json=request)
        self._post(url, "/update_weight_version", json={"new_version": adapter.name})

    def adapter_directory(self) -> Path:
        """Where the next version's adapter is to be saved (peft's layout: `adapter_config.json` at its root),
        published atomically by the saver (a rename), then loaded everywhere by `publish_adapter`."""
        return self.directory / f"{VERSION_PREFIX}{self.version + 1}"

    def publish_adapter(self) -> None:
        """Load the adapter saved in `adapter_directory()` on every server: between `pause` and `resume`, as
        `send_weights`; `retire_stale_adapter` follows the resume."""
        started = time.perf_counter()
        adapter = self.adapter_directory()
        if not is_adapter(adapter):
            raise WeightSyncError(f"weight sync: no adapter was saved in {adapter}")
        self.bytes_written = directory_bytes(adapter)
        self.version += 1  # from here a server being admitted catches up to this version
        targets = self._each(lambda url: self._load(url, adapter), "load_lora_adapter")
        elapsed = time.perf_counter() - started
        self.sync_seconds.append(elapsed)
        logger.info("weight sync v%d: adapter of %.2f MB to %d server(s) in %.2fs", self.version,
                    self.bytes_written / 1e6, len(targets), elapsed)

    def retire_stale_adapter(self) -> None:
        """Unload, once the servers generate again (frozen requests may still use it), the adapter version that
        left the window, and delete the files of the one before it: vLLM reads an adapter's files lazily and a
        missing one kills its engine, so they outlive the unload by one sync."""
        stale = self.version - self.adapter_window
        if stale > 0:
            # An unload that fails leaves one more adapter in the server's cache, which evicts the least recently
            # used: never a reason to take a server out of the pool.
            for url in (self.servers.ready_urls() if self.servers is not None else self.server_urls):
                try:
                    self._post(url, "/v1/unload_lora_adapter", json={"lora_name": adapter_name(stale)})
                except WeightSyncError as error:
                    logger.info("weight sync: %s kept adapter %s: %s", url, adapter_name(stale), error)
        kept = range(max(stale, 1), self.version + 1)
        remove_other_versions(self.directory, keep=[f"{VERSION_PREFIX}{version}" for version in kept])

    def resume(self) -> None:
        try:
            self._each(lambda url: self._post(url, "/resume"), "resume")
        finally:
            if self.servers is not None:
                self.servers.sync_ended(self.version)

    def catch_up(self, url: str) -> None:
        """Bring a (re)started server to the current weights and let it generate: the supervision's admission hook."""
        loaded = 0
        while self.version != loaded:  # a sync that published a newer version meanwhile may not have reached it
            target = self.version
            current = self.directory / f"{VERSION_PREFIX}{target}"
            if not current.is_dir():
                break
            if is_adapter(current):
                # Requests retried from another server may still name any adapter in the window, oldest first.
                for version in range(max(loaded + 1, target - self.adapter_window + 1, 1), target):
                    older = self.directory / f"{VERSION_PREFIX}{version}"
                    if is_adapter(older):
                        self._load(url, older)
            self._load(url, current)
            loaded = target
            logger.info("rollout server %s caught up to %s", url, current.name)
        self._post(url, "/resume")  # a server left paused by a failed sync generates nothing

    def destroy(self) -> None:
        """Nothing to release: the last checkpoint stays, so a restarted server can be pointed at it."""


_VERSION_DIR = re.compile(rf"^{re.escape(VERSION_PREFIX)}(\d+)$")


def resume_version(directory: Path) -> int:
    """The newest complete version in `directory` (0 if none), after removing partial and older version directories.

    A restarted learner keeps counting from there: servers report `vN` and a restart that began again at `v1` would
    show an older-looking version on a newer policy (and overwrite the directory a live server may still read).
    """
    versions = [int(m.group(1)) for entry in directory.iterdir() if (m := _VERSION_DIR.match(entry.name))]
    newest = max(versions, default=0)
    remove_other_versions(directory, keep=[f"{VERSION_PREFIX}{newest}"] if newest else [])
    return newest


def _version_of(checkpoint: Path) -> int:
    match = _VERSION_DIR.match(checkpoint.name)
    if match is None:
        raise WeightSyncError(f"weight sync: {checkpoint} is not a version directory")
    return int(match.group(1))


def remove_other_versions(directory: Path, keep: list[str]) -> None:
    """Delete every version and partial directory but those in `keep` (what servers serve and a restarted one
    loads)."""
    for entry in directory.iterdir():
        is_version = bool(_VERSION_DIR.match(entry.name)) or entry.name.startswith(f".{VERSION_PREFIX}")
        if entry.is_dir() and is_version and entry.name not in keep:
            shutil.rmtree(entry, ignore_errors=True)


def make_weight_transfer(
    config: RunConfig, *, ready_timeout_s: float = 240.0, tied_embeddings: bool = False,
    servers: ServerSet | None = None,
) -> FilesystemWeightTransfer | None:
    """The backend for the run: None lets TRL build its NCCL WeightTransferClient (GPU); filesystem on CPU."""
    sync = config.rollout.weight_sync
    if sync.mode == "nccl":
        return None
    if not sync.directory:
        raise ValueError("rollout.weightSync.directory must be set when rollout.weightSync.mode is filesystem")
    return FilesystemWeightTransfer(
        config.rollout.urls, sync.directory, ready_timeout_s=ready_timeout_s,
        aliases=TIED_EMBEDDING_ALIASES if tied_embeddings else None, servers=servers,
        adapter_window=config.training.max_staleness + 1,
    )
