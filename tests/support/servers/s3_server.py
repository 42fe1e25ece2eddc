"""A real S3-compatible server for the tests: SeaweedFS's `weed server -s3` (built from its Go module by
hack/s3/build.sh), one per test run, started the first time a test asks for it (registered as a plugin in
conftest.py).

Master, volume server, filer and S3 gateway run in one process on loopback ports from `free_port`, with their data
under the session's tmp folder. One identity with an access key and a secret may do everything, and buckets are
never created on the fly (SeaweedFS creates them on upload for admins by default): a missing bucket stays missing.

`s3_server`: the running server (its endpoint, keys and a boto3 client); `s3_bucket`: a fresh empty bucket per test.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.builds import Build
from tests.support.controlplane.control_plane import _die_with_parent, go_build
from tests.support.paths import REPO
from tests.support.ports import LOOPBACK, free_port

BUILD_SCRIPT = REPO / "hack" / "s3" / "build.sh"
BUILD_NAME = "seaweedfs"  # its name in hack/lib/build-times
ACCESS_KEY = "grpo-test-access"
SECRET_KEY = "grpo-test-secret-0123456789"
START_TIMEOUT_S = 120.0
# On SIGTERM the S3 gateway keeps retrying its filer subscription after the filer has stopped, and weed does not exit
# (seen: still running after 15 s); its data is the run's to throw away, so it is killed after this.
STOP_GRACE_S = 3.0
# Each bucket is a collection of its own, for which the master grows 7 volumes on its first write. The volumes are
# small (nothing is preallocated; big enough for the tests' models), and the server may hold VOLUMES_MAX of them: a
# fixed number, not -volume.max=0's "as many as the free disk holds at 64 MiB each", which refused the writes to a
# run's later buckets with InternalError on a machine with a few GB free.
VOLUME_SIZE_LIMIT_MB = 64
VOLUMES_MAX = 2000

_buckets = itertools.count()


def build() -> Build:
    """The build of SeaweedFS's `weed` (hack/s3/build.sh); Unavailable without Go (the tests that need it skip)."""
    return go_build(BUILD_NAME, [str(BUILD_SCRIPT)], "the S3 test server (SeaweedFS) is")


@dataclass
class S3Server:
    """`weed server -s3` in `workdir`: start() returns once its S3 gateway answers a signed request."""

    workdir: Path
    bin_dir: Path
    process: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.port = free_port()

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def env(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
        """The variables a client reads (those a Secret mounted as env would set)."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": access_key,
                "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_REGION": "us-east-1"}

    def client(self, **keys: str):
        from grpo_trainer.storage.object_store import client_from_env

        return client_from_env(self.env(**keys))

    def start(self, timeout: float = START_TIMEOUT_S) -> S3Server:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self.workdir / "s3.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "grpo-test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        ports = {flag: free_port() for flag in ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                                               "filer.port", "filer.port.grpc", "s3.port.grpc")}
        command = [str(self.bin_dir / "weed"), "server", f"-dir={data}", f"-ip={LOOPBACK}",
                   f"-ip.bind={LOOPBACK}", "-filer", "-s3", f"-s3.port={self.port}", f"-s3.config={identities}",
                   "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                   "-master.telemetry=false", f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
                   f"-volume.max={VOLUMES_MAX}", "-volume.preStopSeconds=0",
                   f"-filer.localSocket={self.workdir / 'filer.sock'}", f"-s3.localSocket={self.workdir / 's3.sock'}",
                   *(f"-{flag}={port}" for flag, port in ports.items())]
        log = open(self.workdir / "weed.log", "wb")  # noqa: SIM115 (kept open for the process's life)
        # cwd: the filer looks for a filer.toml in ./ first; there is none in the data folder.
        self.process = subprocess.Popen(command, cwd=data, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=_die_with_parent)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until a bucket can be created and listed: the gateway answers before the filer and the volume server
        have registered with the master, and refuses writes until then."""
        deadline = time.monotonic() + timeout
        client = self.client()
        last = "no answer yet"
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                client.create_bucket(Bucket="grpo-ready")
                client.put_object(Bucket="grpo-ready", Key="ready", Body=b"ready")
                client.delete_object(Bucket="grpo-ready", Key="ready")
                return
            except Exception as error:  # noqa: BLE001 (any refusal means not ready yet; the last one is reported)
                last = f"{type(error).__name__}: {error}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS's S3 gateway did not take a write in {timeout} s ({last}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        path = self.workdir / "weed.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def s3_server(seaweedfs_binaries: Path, tmp_path_factory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3-server"), seaweedfs_binaries)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the session's server."""
    name = f"grpo-test-{next(_buckets)}"
    s3_server.client().create_bucket(Bucket=name)
    return name

