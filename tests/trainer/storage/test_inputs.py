"""grpo_trainer.storage.inputs: where the learner and the rollout server load the model and the dataset from, s3://
inputs downloaded once into the inputs cache, against the real S3-compatible server (SeaweedFS,
tests/support/servers/s3_server.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from grpo_trainer.contract.codes import EXIT_INVALID_CONFIG, EXPORT_MANIFEST_FILE
from grpo_trainer.contract.config import (
    DatasetConfig,
    InputsConfig,
    LearnerConfig,
    RewardConfig,
    RunConfig,
    load_run_config,
)
from grpo_trainer.contract.report import parse_progress
from grpo_trainer.contract.store_uri import parse_uri
from grpo_trainer.storage.inputs import InputError, local_path, resolve, store_environ
from grpo_trainer.storage.object_store import client_from_env, upload_folder
from tests.support.ports import free_port


def _config(tmp_path: Path, model: str, dataset: str = "/dev/null", **inputs) -> RunConfig:
    return RunConfig(model=model, dataset=DatasetConfig(path=dataset), rewards=[RewardConfig(name="length")],
                     inputs=InputsConfig(cache_dir=str(tmp_path / "cache"), **inputs))


def _files(folder) -> dict[str, bytes]:
    folder = Path(folder)
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


class RequestCounter:
    """Every request a boto3 client sends (its `before-send` event), by operation."""

    def __init__(self, client):
        self.operations: list[str] = []
        client.meta.events.register("before-send.s3", self._record)

    def _record(self, request, **_):
        self.operations.append(request.method)


def test_a_hub_id_or_a_path_stays_as_it_is(tmp_path):
    config = _config(tmp_path, "Qwen/Qwen3-0.6B", dataset=str(tmp_path))
    assert resolve(config, dataset=True, environ={}) == config


def test_a_missing_path_is_named_with_its_field(tmp_path):
    with pytest.raises(InputError, match=r"^model: /var/lib/grpo/inputs/nope: no such file or directory"):
        resolve(_config(tmp_path, "/var/lib/grpo/inputs/nope"), dataset=False, environ={})
    with pytest.raises(InputError, match=r"^dataset.path: /nope.jsonl: no such file"):
        resolve(_config(tmp_path, "Qwen/Qwen3-0.6B", dataset="/nope.jsonl"), dataset=True, environ={})


def test_the_local_path_of_a_uri_depends_on_the_uri_and_the_cache_alone(tmp_path):
    config = _config(tmp_path, "s3://models/runs/tiny")
    path = local_path("s3://models/runs/tiny", config, environ={})
    assert path == local_path("s3://models/runs/tiny/", config, environ={"HOME": "/elsewhere"})
    assert path.startswith(str(tmp_path / "cache")) and path.endswith("/tiny")
    assert local_path("s3://models/other/tiny", config, environ={}) != path
    assert local_path("s3://data/prompts.jsonl", config, environ={}).endswith("/prompts.jsonl")


def test_the_inputs_credentials_come_before_the_machines_and_the_spec_names_the_endpoint():
    environ = {"AWS_ACCESS_KEY_ID": "output-key", "AWS_SECRET_ACCESS_KEY": "output-secret",
               "GRPO_INPUTS_AWS_ACCESS_KEY_ID": "input-key", "GRPO_INPUTS_AWS_SECRET_ACCESS_KEY": "input-secret",
               "AWS_ENDPOINT_URL_S3": "http://output:9000", "PATH": "/bin"}
    env = store_environ(InputsConfig(endpoint="http://inputs:8333", region="eu-west-1"), environ)
    assert env["AWS_ACCESS_KEY_ID"] == "input-key" and env["AWS_SECRET_ACCESS_KEY"] == "input-secret"
    assert env["AWS_ENDPOINT_URL_S3"] == "http://inputs:8333" and env["AWS_REGION"] == "eu-west-1"
    assert "PATH" not in env


@pytest.mark.parametrize(("inputs", "environ", "message"), [
    ({"hub_token_secret": "hub"}, {}, "inputs.hubTokenSecret: Secret 'hub' gave no HF_TOKEN"),
    ({"credentials_secret": "store"}, {"GRPO_INPUTS_AWS_ACCESS_KEY_ID": "k"},
     "inputs.credentialsSecret: Secret 'store' gave no AWS_SECRET_ACCESS_KEY"),
])
def test_a_secret_that_did_not_arrive_is_named(tmp_path, inputs, environ, message):
    with pytest.raises(InputError, match=f"^{message}"):
        resolve(_config(tmp_path, "s3://models/tiny", **inputs), dataset=False, environ=environ)


@pytest.mark.s3
def test_an_exported_model_is_downloaded_once_and_read_from_the_cache_while_the_store_holds_it(
        s3_server, s3_bucket, tiny_model_dir, tmp_path, caplog):
    upload_folder(tiny_model_dir, parse_uri(f"s3://{s3_bucket}/runs/tiny", "output.uri"), client=s3_server.client())
    config = _config(tmp_path, f"s3://{s3_bucket}/runs/tiny", endpoint=s3_server.endpoint,
                     credentials_secret="store")
    environ = {f"GRPO_INPUTS_{name}": value for name, value in s3_server.env().items()
               if name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}

    first = client_from_env(store_environ(config.inputs, environ))
    first_requests = RequestCounter(first)
    loaded = resolve(config, dataset=False, environ=environ, client=first)
    assert first_requests.operations, "the first start downloads"
    folder = Path(loaded.model)
    assert {**_files(tiny_model_dir), EXPORT_MANIFEST_FILE: (folder / EXPORT_MANIFEST_FILE).read_bytes()} \
        == _files(folder)
    assert _staged(folder) == [], "no staging folder is left"

    # A restarted pod on the same cache: it reads the store's manifest alone, which is the cached one.
    second = client_from_env(store_environ(config.inputs, environ))
    second_requests = RequestCounter(second)
    again = resolve(config, dataset=False, environ=environ, client=second)
    assert again.model == loaded.model and second_requests.operations == ["GET"]

    # A store that cannot be asked leaves the cached copy in use, with a warning naming it.
    unreachable = {**environ, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}"}
    offline = resolve(config.model_copy(update={"inputs": InputsConfig(cache_dir=config.inputs.cache_dir,
                                                                       credentials_secret="store")}),
                      dataset=False, environ=unreachable, client=client_from_env(unreachable))
    assert offline.model == loaded.model and "could not be compared with the store" in caplog.text


def _staged(folder: Path) -> list[str]:
    """What a download or a replacement left beside the cached copy, other than its lock and its source record."""
    return [path.name for path in folder.parent.iterdir()
            if path.name not in (folder.name, ".lock", f".{folder.name}.source")]


@pytest.mark.s3
def test_a_model_or_dataset_changed_in_the_store_is_downloaded_again(s3_server, s3_bucket, tiny_model_dir, tmp_path):
    client = s3_server.client()
    location = parse_uri(f"s3://{s3_bucket}/runs/changing", "output.uri")
    upload_folder(tiny_model_dir, location, client=client)
    client.put_object(Bucket=s3_bucket, Key="data/changing.jsonl", Body=b'{"prompt": "one"}\n')
    config = _config(tmp_path, location.uri, dataset=f"s3://{s3_bucket}/data/changing.jsonl")
    first = resolve(config, dataset=True, environ={}, client=client)

    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, changed)
    (changed / "generation_config.json").write_text('{"temperature": 0.5}')
    upload_folder(changed, location, client=client)  # a new export to the same prefix
    client.put_object(Bucket=s3_bucket, Key="data/changing.jsonl", Body=b'{"prompt": "two"}\n')
    second = resolve(config, dataset=True, environ={}, client=client)
    assert (second.model, second.dataset.path) == (first.model, first.dataset.path)  # the same place, new content
    assert _files(second.model) == {**_files(changed), EXPORT_MANIFEST_FILE: (
        Path(second.model) / EXPORT_MANIFEST_FILE).read_bytes()}
    assert Path(second.dataset.path).read_bytes() == b'{"prompt": "two"}\n'
    assert _staged(Path(second.model)) == [] and _staged(Path(second.dataset.path)) == []


@pytest.mark.s3
def test_a_dataset_file_and_a_folder_without_a_manifest_are_downloaded(s3_server, s3_bucket, tiny_model_dir,
                                                                       tmp_path):
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="data/prompts.jsonl", Body=b'{"prompt": "hi"}\n')
    for path in sorted(Path(tiny_model_dir).iterdir()):
        client.upload_file(str(path), s3_bucket, f"plain/tiny/{path.name}")
    config = _config(tmp_path, f"s3://{s3_bucket}/plain/tiny", dataset=f"s3://{s3_bucket}/data/prompts.jsonl")

    loaded = resolve(config, dataset=True, environ={}, client=client)
    assert loaded.dataset.path.endswith("/prompts.jsonl")
    assert Path(loaded.dataset.path).read_bytes() == b'{"prompt": "hi"}\n'
    assert _files(Path(loaded.model)) == _files(tiny_model_dir)


class _BreaksAfterOneFile:
    """A client whose second file download fails, as a killed pod's would stop: nothing may read as complete."""

    def __init__(self, client):
        self._client, self.downloads = client, 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def download_file(self, *args, **kwargs):
        self.downloads += 1
        if self.downloads > 1:
            raise OSError(28, "No space left on device")
        return self._client.download_file(*args, **kwargs)


@pytest.mark.s3
def test_a_download_that_stops_halfway_leaves_nothing_that_reads_as_complete(s3_server, s3_bucket, tiny_model_dir,
                                                                            tmp_path):
    client = s3_server.client()
    for path in sorted(Path(tiny_model_dir).iterdir()):
        client.upload_file(str(path), s3_bucket, f"plain/tiny/{path.name}")
    config = _config(tmp_path, f"s3://{s3_bucket}/plain/tiny")

    with pytest.raises(InputError, match=r"^model: s3://.*No space left on device"):
        resolve(config, dataset=False, environ={}, client=_BreaksAfterOneFile(client))
    target = Path(local_path(config.model, config, environ={}))
    assert not target.exists() and [path.name for path in target.parent.iterdir()] == [".lock"]
    assert _files(Path(resolve(config, dataset=False, environ={}, client=client).model)) == _files(tiny_model_dir)


@pytest.mark.s3
@pytest.mark.parametrize(("uri", "keys", "cause"), [
    ("s3://no-such-bucket/runs/tiny", {}, "the bucket 'no-such-bucket' does not exist"),
    ("s3://{bucket}/runs/tiny", {"access_key": "nobody"}, "the access key (AWS_ACCESS_KEY_ID) is not known"),
    ("s3://{bucket}/nothing/here", {}, "no such object, and no objects under it"),
])
def test_an_input_the_store_cannot_give_is_named(s3_server, s3_bucket, tmp_path, uri, keys, cause):
    config = _config(tmp_path, uri.format(bucket=s3_bucket))
    with pytest.raises(InputError) as refused:
        resolve(config, dataset=False, environ={}, client=s3_server.client(**keys))
    message = str(refused.value)
    assert message.startswith(f"model: {config.model}") and cause in message and "\n" not in message, message
    assert not Path(local_path(config.model, config, environ={})).exists()
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def _write_config(tmp_path: Path, model: str, **inputs) -> Path:
    path = tmp_path / "run.json"
    path.write_text(RunConfig(
        model=model, dataset=DatasetConfig(path="/dev/null"), rewards=[RewardConfig(name="constant")],
        learner=LearnerConfig(device="cpu"),
        inputs=InputsConfig(cache_dir=str(tmp_path / "cache"), **inputs),
        termination_message_path=str(tmp_path / "termination-log")).model_dump_json(by_alias=True))
    (tmp_path / "termination-log").write_text("")
    return path


def _input_credentials(s3_server, monkeypatch, **keys) -> None:
    for name, value in s3_server.env(**keys).items():
        if name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(f"GRPO_INPUTS_{name}", value)


@pytest.mark.s3
def test_the_rollout_server_starts_on_the_downloaded_model_and_its_probe_names_it(
        s3_server, s3_bucket, tiny_model_dir, tmp_path, monkeypatch):
    import grpo_trainer.server.main
    from grpo_trainer.__main__ import main as entry_main

    upload_folder(tiny_model_dir, parse_uri(f"s3://{s3_bucket}/tiny", "output.uri"), client=s3_server.client())
    _input_credentials(s3_server, monkeypatch)
    path = _write_config(tmp_path, f"s3://{s3_bucket}/tiny", endpoint=s3_server.endpoint, credentials_secret="s")
    started = []
    monkeypatch.setattr(grpo_trainer.server.main, "main", lambda config, port: started.append(config) or 0)

    assert entry_main(["rollout", "--config", str(path)]) == 0
    (config,) = started
    assert (Path(config.model) / "config.json").is_file()
    assert config.model == local_path(f"s3://{s3_bucket}/tiny", load_run_config(path.read_text()))

    # A new replica on the same model cache: where nothing listens, any request to the store would end it.
    _write_config(tmp_path, f"s3://{s3_bucket}/tiny", endpoint=f"http://127.0.0.1:{free_port()}",
                  credentials_secret="s")
    assert entry_main(["rollout", "--config", str(path)]) == 0
    assert started[1].model == config.model


@pytest.mark.s3
def test_a_rollout_server_whose_model_the_store_lacks_exits_78_naming_it(s3_server, tmp_path, monkeypatch, capsys):
    from grpo_operator.status.rollout_exits import rollout_error_line
    from grpo_trainer.__main__ import main as entry_main

    _input_credentials(s3_server, monkeypatch)
    path = _write_config(tmp_path, "s3://no-such-bucket/tiny", endpoint=s3_server.endpoint)

    assert entry_main(["rollout", "--config", str(path)]) == EXIT_INVALID_CONFIG
    error = capsys.readouterr().err.strip()
    expected = "model: s3://no-such-bucket/tiny: the bucket 'no-such-bucket' does not exist"
    assert error == f"grpo rollout: the model cannot be loaded: {expected}"
    assert rollout_error_line((tmp_path / "termination-log").read_text()) == expected


@pytest.mark.s3
def test_a_learner_whose_model_the_store_refuses_exits_78_naming_it(s3_server, s3_bucket, tmp_path, monkeypatch):
    from grpo_trainer.learner.main import main

    _input_credentials(s3_server, monkeypatch, secret_key="wrong-secret")
    config = load_run_config(_write_config(tmp_path, f"s3://{s3_bucket}/tiny", endpoint=s3_server.endpoint,
                                           credentials_secret="store").read_text())
    assert main(config) == EXIT_INVALID_CONFIG
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.message == (f"model: s3://{s3_bucket}/tiny: the secret key (AWS_SECRET_ACCESS_KEY) does not match "
                              "the access key (SignatureDoesNotMatch)")


def _pinned_folder(tmp_path: Path, tiny_model_dir) -> tuple[Path, str]:
    """A path model holding an export manifest, and its digest."""
    from grpo_trainer.storage.object_store import manifest_identity

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / EXPORT_MANIFEST_FILE).write_text('{"files": [], "step": 8}')
    return folder, manifest_identity((folder / EXPORT_MANIFEST_FILE).read_bytes())


def test_a_path_models_digest_is_its_manifests_and_a_pinned_one_must_match(tmp_path, tiny_model_dir):
    from grpo_trainer.storage.inputs import loaded_digest

    folder, digest = _pinned_folder(tmp_path, tiny_model_dir)
    assert loaded_digest(str(folder)) == digest and digest.startswith("manifest:")
    assert loaded_digest(tiny_model_dir) is None and loaded_digest("Qwen/Qwen3-0.6B") is None
    config = _config(tmp_path, str(folder))
    assert resolve(config, dataset=False, environ={"GRPO_MODEL_DIGEST": digest}).model == str(folder)
    assert resolve(config, dataset=False, environ={}).model == str(folder)  # not pinned (yet): anything loads

    (folder / EXPORT_MANIFEST_FILE).write_text('{"files": [], "step": 12}')  # another export in its place
    changed = loaded_digest(str(folder))
    with pytest.raises(InputError) as refused:
        resolve(config, dataset=False, environ={"GRPO_MODEL_DIGEST": digest})
    assert str(refused.value) == (
        f"model: {folder} holds {changed}, not {digest}, the content the run pinned when it started "
        "(status.model.revision): it changed since; put that content back, or start a new run for the new one")
    (folder / EXPORT_MANIFEST_FILE).unlink()
    with pytest.raises(InputError, match=r"holds a model without an export manifest, not manifest:"):
        resolve(config, dataset=False, environ={"GRPO_MODEL_DIGEST": digest})


def test_a_rollout_server_or_learner_started_after_the_model_changed_exits_78_naming_both_digests(
        tmp_path, tiny_model_dir, monkeypatch, capsys):
    from grpo_operator.status.rollout_exits import rollout_error_line
    from grpo_trainer.__main__ import main as entry_main
    from grpo_trainer.learner.main import main as learner_main

    folder, digest = _pinned_folder(tmp_path, tiny_model_dir)
    (folder / EXPORT_MANIFEST_FILE).write_text('{"files": [], "step": 12}')
    monkeypatch.setenv("GRPO_MODEL_DIGEST", digest)
    path = _write_config(tmp_path, str(folder))

    assert entry_main(["rollout", "--config", str(path)]) == EXIT_INVALID_CONFIG
    line = rollout_error_line((tmp_path / "termination-log").read_text())
    assert line.startswith(f"model: {folder} holds manifest:") and f", not {digest}, the content the run pinned" in line

    assert learner_main(load_run_config(path.read_text())) == EXIT_INVALID_CONFIG
    report = parse_progress((tmp_path / "termination-log").read_text())
    assert report.message.startswith(f"model: {folder} holds manifest:") and f"not {digest}" in report.message


@pytest.mark.s3
def test_a_pinned_model_changed_in_the_store_is_refused_before_its_download(s3_server, s3_bucket, tiny_model_dir,
                                                                            tmp_path):
    from grpo_trainer.storage.inputs import loaded_digest

    client = s3_server.client()
    location = parse_uri(f"s3://{s3_bucket}/runs/pinned", "output.uri")
    upload_folder(tiny_model_dir, location, client=client)
    config = _config(tmp_path, location.uri)
    first = resolve(config, dataset=False, environ={}, client=client)
    pinned = loaded_digest(first.model)
    assert pinned is not None and pinned.startswith("manifest:")
    assert resolve(config, dataset=False, environ={"GRPO_MODEL_DIGEST": pinned}, client=client).model == first.model

    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, changed)
    (changed / "generation_config.json").write_text('{"temperature": 0.5}')
    upload_folder(changed, location, client=client)
    cached = _files(first.model)
    with pytest.raises(InputError, match=rf"^model: {location.uri} holds manifest:\w+, not {pinned}, the content"):
        resolve(config, dataset=False, environ={"GRPO_MODEL_DIGEST": pinned}, client=client)
    assert _files(first.model) == cached  # the pinned copy stays in the cache
