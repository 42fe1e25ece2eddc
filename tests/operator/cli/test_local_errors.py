"""`grporun local`: user mistakes end in one line naming the problem and a non-zero exit, before anything starts;
the local processes are the operator's pods (same commands and environment) with local paths and ports."""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys

import pytest
import yaml

from grpo_operator import builders
from grpo_operator.api import EnvironmentSpec, parse_spec
from grpo_operator.cli import main as grporun
from grpo_operator.exit_codes import ExitCode
from grpo_operator.local.console import final_summary
from grpo_operator.local.plan import (
    VLLM_CPU_BIND_ENV,
    LocalError,
    LocalPorts,
    LocalProbe,
    ProcessPlan,
    expand_references,
    local_probe,
    localize_spec,
    observe,
    plan_processes,
)
from grpo_operator.local.processes import LocalProcess, read_progress_blocking
from grpo_operator.local.supervise import LocalPort, LocalRun, prepare
from grpo_operator.manifest import read_grporun
from grpo_operator.run_ref import RunRef
from grpo_trainer.contract.config import load_run_config
from grpo_trainer.contract.pod_env import MODEL_DIGEST_ENV
from tests.support.paths import REPO
from tests.support.ports import LOOPBACK, free_port
from tests.support.servers.hub_server import commit_of
from tests.support.servers.raw_answer import answering_once
from tests.support.specs import minimal_spec

TINY = REPO / "examples" / "tiny.yaml"


@pytest.fixture
def tiny_manifest(tmp_path, tiny_model_dir) -> dict:
    manifest = yaml.safe_load(TINY.read_text())
    manifest["spec"]["model"] = tiny_model_dir
    manifest["spec"]["dataset"]["path"] = str(REPO / "examples" / "tiny-prompts.jsonl")
    return manifest


def run_local(tmp_path, manifest: dict | str, capsys) -> tuple[int, list[str]]:
    path = tmp_path / "run.yaml"
    path.write_text(manifest if isinstance(manifest, str) else yaml.safe_dump(manifest))
    code = grporun(["local", str(path), "--runs-dir", str(tmp_path / "runs"), "--rollout-url", "http://127.0.0.1:9"])
    return code, capsys.readouterr().err.strip().splitlines()


def mutate(manifest: dict, change) -> dict:
    manifest = copy.deepcopy(manifest)
    change(manifest["spec"])
    return manifest


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: s["training"].update(epoch=3), "spec.training.epoch"),
        (lambda s: s["training"].update(epochs="many"), "spec.training.epochs"),
        (lambda s: s.pop("model"), "spec.model"),
        (lambda s: s.update(rewards=[{"name": "nope"}]), "spec.rewards[0].name: unknown reward 'nope'"),
        (lambda s: s.update(rewards=[{"function": "no_such_mod_q:f"}]), "spec.rewards[0].function"),
        (lambda s: s.update(model="./no-such-model"), "spec.model:"),
        (lambda s: s["dataset"].update(path="/no/such/prompts.jsonl"), "spec.dataset.path:"),
        (lambda s: s["learner"].update(nodes=2), "spec.learner.nodes"),
        (lambda s: s["rewards"].append({"model": "./no-such-rm"}), "spec.rewards[1].model: "),
        (lambda s: s.update(environments=[{"name": "guess", "image": "guess:1"}]),
         "spec.environments[0].command: grporun local runs the server's command on this machine"),
        (lambda s: s.update(environments=[{"name": "guess", "image": "guess:1", "command": ["guess"],
                                           "readinessProbe": {"grpc": {"port": 8000}}}]),
         "spec.environments[0].readinessProbe: grporun local runs tcpSocket, httpGet and exec probes only"),
        (lambda s: s.update(environments=[{"name": "guess", "image": "guess:1", "command": ["guess"],
                                           "readinessProbe": {"httpGet": {"path": "/", "port": 9090}}}]),
         "spec.environments[0].readinessProbe: port 9090: a local server has one port"),
    ],
    ids=["unknown-field", "wrong-type", "missing-model", "unknown-reward", "bad-reward-import", "missing-model-dir",
         "missing-dataset", "multi-node", "missing-reward-model-dir", "environment-without-command",
         "environment-grpc-probe", "environment-probe-of-another-port"],
)
def test_bad_manifest_gives_one_line_naming_the_field(tmp_path, tiny_manifest, capsys, change, expected):
    code, lines = run_local(tmp_path, mutate(tiny_manifest, change), capsys)
    assert code != 0
    assert len(lines) == 1, lines
    assert expected in lines[0]
    assert "Traceback" not in lines[0]


def test_unreadable_and_non_yaml_files(tmp_path, capsys):
    code = grporun(["local", str(tmp_path / "missing.yaml")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "cannot read" in lines[0]
    code, lines = run_local(tmp_path, "spec: [unclosed", capsys)
    assert code != 0 and len(lines) == 1 and "not valid YAML" in lines[0]


def test_relative_paths_are_relative_to_the_manifest(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    spec = read_grporun(TINY).spec.model_copy(update={"model": "./m"}, deep=True)
    spec.dataset.path = "./p.jsonl"
    local = localize_spec(spec, tmp_path)
    assert local.model == str(tmp_path / "m")
    assert local.dataset.path == str(tmp_path / "p.jsonl")
    hub = localize_spec(spec.model_copy(update={"model": "Qwen/Qwen3-0.6B"}), tmp_path)
    assert hub.model == "Qwen/Qwen3-0.6B"  # a hub id is left to the learner


def test_processes_run_the_pods_commands_and_env():
    spec = read_grporun(TINY).spec
    plans = plan_processes("tiny", "default", spec, "/runs/tiny/run.json", rollout_python="/rv/python",
                           learner_python="/lv/python", ports=LocalPorts([8111], 9411, 29511))
    rollout, learner = plans
    pod_rollout = builders.rollout_command()
    assert rollout.argv == ["/rv/python", *pod_rollout[1:-1], "/runs/tiny/run.json", "--port", "8111"]
    assert rollout.name == builders.rollout_pod_name("tiny", 0) and rollout.url == "http://127.0.0.1:8111"
    assert learner.argv == ["/lv/python", *builders.learner_command(RunRef("tiny", "default", "local"), spec, 0)[1:-1],
                            "/runs/tiny/run.json"]
    assert learner.env["GRPO_RUN"] == "tiny" and learner.env["GRPO_CONFIG"] == "/runs/tiny/run.json"
    assert "HOME" not in learner.env  # the pod's HOME is a container path
    assert "OMP_NUM_THREADS" not in learner.env  # only set when the cores to share are known


def test_a_cpu_learner_gets_its_share_of_the_cores_as_openmp_threads():
    spec = read_grporun(TINY).spec
    plan = dict(rollout_python="/rv", learner_python="/lv", ports=LocalPorts([1], 2, 3))
    assert plan_processes("tiny", "default", spec, "/r.json", cpu_count=2, **plan)[-1].env["OMP_NUM_THREADS"] == "1"
    assert plan_processes("tiny", "default", spec, "/r.json", cpu_count=16, **plan)[-1].env["OMP_NUM_THREADS"] == "8"
    spec.learner.device = "cuda"
    assert "OMP_NUM_THREADS" not in plan_processes("tiny", "default", spec, "/r.json", cpu_count=16, **plan)[-1].env


def test_several_learner_processes_run_under_accelerate_on_localhost():
    spec = read_grporun(TINY).spec
    spec.learner.processes_per_node = 2
    learner = plan_processes("tiny", "default", spec, "/r.json", rollout_python="/rv", learner_python="/lv",
                             ports=LocalPorts([1], 2, 29533))[-1]
    argv = learner.argv
    assert argv[:3] == ["/lv", "-m", "grpo_trainer.learner.gang"]
    assert argv[6:9] == ["/lv", "-m", "accelerate.commands.launch"]
    assert argv[argv.index("--main_process_ip") + 1] == "127.0.0.1"
    assert argv[argv.index("--main_process_port") + 1] == "29533"
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert argv[-2:] == ["--config", "/r.json"]


def test_exited_processes_look_like_finished_pods():
    plan = ProcessPlan("tiny-learner-0", "learner", ["x"], {})
    assert observe(plan, None, ready=True, message=None).phase == "Running"
    done = observe(plan, 0, ready=False, message="{}")
    assert (done.phase, done.exit_code) == ("Succeeded", 0)
    stalled = observe(plan, 42, ready=False, message="stalled")
    assert (stalled.phase, stalled.exit_code, stalled.message) == ("Failed", 42, "stalled")


def test_final_summary_shows_phase_reason_and_progress():
    status = {
        "phase": "Failed", "message": "learner exited with code 42",
        "failure": {"reason": "Stalled"},
        "progress": {"epoch": 0, "epochs": 1, "groupsConsumed": 16, "groupsTotal": 16, "groupsTrained": 0,
                     "groupsDropped": 16, "dropped": {"no_signal": 16, "stale": 0}, "globalStep": 0},
    }
    text = final_summary(status)
    assert "phase: Failed  reason: Stalled" in text
    assert "groups consumed 16/16" in text and "{'no_signal': 16}" in text


@pytest.mark.parametrize("example", ["tiny.yaml", "gpu.yaml", "tiny-rm.yaml"])
def test_shipped_examples_validate_and_use_builtin_rewards(example):
    from grpo_trainer.learner.rewards import BUILTIN_REWARDS

    spec = read_grporun(REPO / "examples" / example).spec
    assert all(reward.name in BUILTIN_REWARDS for reward in spec.rewards if not reward.is_model)
    assert all(reward.model.startswith("./tiny-assets/") for reward in spec.rewards if reward.is_model)


def test_several_cpu_rollout_servers_are_pinned_to_different_cores():
    spec = read_grporun(TINY).spec
    spec.rollout.replicas = 3
    plan = dict(rollout_python="/rv", learner_python="/lv", ports=LocalPorts([1, 4, 5], 2, 3))
    rollouts = plan_processes("tiny", "default", spec, "/r.json", cpu_count=2, **plan)[:-1]
    assert [p.env[VLLM_CPU_BIND_ENV] for p in rollouts] == ["0", "1", "0"]
    single = dict(plan, ports=LocalPorts([1], 2, 3))
    spec.rollout.replicas = 1
    assert VLLM_CPU_BIND_ENV not in plan_processes("tiny", "default", spec, "/r.json", cpu_count=2, **single)[0].env


def test_the_rollout_restart_limit_flag_overrides_the_manifest_and_refuses_a_negative(tmp_path, tiny_manifest,
                                                                                       capsys):
    manifest = mutate(tiny_manifest, lambda s: s.setdefault("runPolicy", {}).update(rolloutRestartLimit=5))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))

    def args(limit):
        return argparse.Namespace(manifest=str(path), runs_dir=str(tmp_path / "runs"), resume=False, fresh=True,
                                  rollout_url=["http://127.0.0.1:9"], rollout_python=None, rollout_restart_limit=limit)

    assert prepare(args(None)).spec.run_policy.rollout_restart_limit == 5
    assert prepare(args(1)).spec.run_policy.rollout_restart_limit == 1
    path.write_text(yaml.safe_dump(tiny_manifest))
    assert prepare(args(None)).spec.run_policy.rollout_restart_limit == 3  # the CRD's default, one owner (api.py)
    with pytest.raises(SystemExit) as exited:
        grporun(["local", str(path), "--runs-dir", str(tmp_path / "runs"), "--rollout-url", "http://127.0.0.1:9",
                 "--rollout-restart-limit", "-1"])
    assert exited.value.code == ExitCode.USAGE
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "grporun local: error: argument --rollout-restart-limit: must be >= 0, not -1")


@pytest.mark.parametrize(("output", "folder", "uri", "note"), [
    # relative to the manifest, like the other paths
    ({"volume": {"hostPath": {"path": "./models"}}}, "models/tiny", None, None),
    ({"volume": {"persistentVolumeClaim": {"claimName": "models"}}}, "runs/tiny/model", None,
     "spec.output.volume is a persistentVolumeClaim, which only a cluster mounts: the model goes to {folder}"),
    # staged in the run's folder, then uploaded with this machine's credentials
    ({"uri": "s3://models/runs/tiny"}, "runs/tiny/model", "s3://models/runs/tiny", None),
    ({"volume": {"hostPath": {"path": "./models"}}, "uri": "s3://models/runs/tiny"}, "models/tiny",
     "s3://models/runs/tiny", None),
    ({"volume": {"persistentVolumeClaim": {"claimName": "models"}}, "uri": "s3://models/runs/tiny"},
     "runs/tiny/model", "s3://models/runs/tiny", "spec.output.volume is a persistentVolumeClaim, which only a cluster "
     "mounts: the model goes to {folder}, then to s3://models/runs/tiny"),
])
def test_a_local_run_exports_to_the_folder_spec_output_names(tmp_path, tiny_manifest, output, folder, uri, note):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(mutate(tiny_manifest, lambda s: s.update(output=output))))
    local = prepare(argparse.Namespace(manifest=str(path), runs_dir=str(tmp_path / "runs"), resume=False, fresh=False,
                                       rollout_url=["http://127.0.0.1:9"], rollout_python=None,
                                       rollout_restart_limit=None))
    config = load_run_config((local.run_dir / "run.json").read_text())
    assert config.output is not None
    assert config.output.directory == str(tmp_path / folder)
    assert config.output.uri == (uri or (tmp_path / folder).as_uri())
    # The spec as the run ran it, for the manifest: local paths made absolute.
    volume = output.get("volume")
    localized = {"hostPath": {"path": str(tmp_path / "models")}} if volume and "hostPath" in volume else volume
    assert config.output.run_spec["output"].get("volume") == localized
    assert local.notes == ([] if note is None else [note.format(folder=tmp_path / folder)])


def test_without_an_output_a_local_run_exports_nothing(tmp_path, tiny_manifest):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_manifest))
    local = prepare(argparse.Namespace(manifest=str(path), runs_dir=str(tmp_path / "runs"), resume=False, fresh=False,
                                       rollout_url=["http://127.0.0.1:9"], rollout_python=None,
                                       rollout_restart_limit=None))
    assert load_run_config((local.run_dir / "run.json").read_text()).output is None


def test_an_earlier_run_folder_is_kept_unless_resume_or_fresh_says_what_to_do(tmp_path, tiny_manifest, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_manifest))
    runs = tmp_path / "runs"

    def args(**flags):
        return argparse.Namespace(manifest=str(path), runs_dir=str(runs), rollout_url=["http://127.0.0.1:9"],
                                  rollout_python=None, rollout_restart_limit=None,
                                  **{"resume": False, "fresh": False, **flags})

    first = prepare(args())
    checkpoint = first.run_dir / "checkpoints" / "checkpoint-3" / "grpo_progress.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text("{}")
    code = grporun(["local", str(path), "--runs-dir", str(runs), "--rollout-url", "http://127.0.0.1:9"])
    assert code == ExitCode.USAGE
    assert capsys.readouterr().err.strip().splitlines() == [
        f"grporun local: {first.run_dir} exists (config, logs, checkpoints of an earlier run): pass --resume to "
        "continue from its newest checkpoint or --fresh to delete it and start over"]
    assert checkpoint.is_file()  # refused: nothing was deleted
    assert prepare(args(resume=True)).run_dir == first.run_dir and checkpoint.is_file()
    assert prepare(args(fresh=True)).run_dir == first.run_dir and not checkpoint.exists()
    with pytest.raises(SystemExit):  # one or the other
        grporun(["local", str(path), "--resume", "--fresh"])


@pytest.mark.parametrize(
    ("change", "validate_sees_it"),
    [(lambda s: s["training"].update(epoch=3), True),
     (lambda s: s.update(rewards=[{"name": "nope"}]), True),
     (lambda s: s.update(model="./no-such-model"), False)],  # a path on this machine: grporun local's own check
    ids=["schema", "reward-name", "local-path"],
)
def test_a_bad_manifest_is_the_same_line_and_exit_code_in_every_command(tmp_path, tiny_manifest, capsys, change,
                                                                        validate_sees_it):
    local_code, local_lines = run_local(tmp_path, mutate(tiny_manifest, change), capsys)
    path = str(tmp_path / "run.yaml")
    assert local_code == ExitCode.INVALID and len(local_lines) == 1 and local_lines[0].startswith(f"{path}: spec.")
    if not validate_sees_it:
        return
    assert grporun(["validate", path]) == ExitCode.INVALID
    assert capsys.readouterr().err.strip().splitlines() == local_lines
    assert grporun(["render", path]) == ExitCode.INVALID
    rendered = capsys.readouterr()
    assert rendered.out == "" and rendered.err.strip().splitlines() == local_lines


def test_a_local_learner_reaches_the_object_store_the_spec_names_with_this_machines_credentials(
        tmp_path, tiny_manifest, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-this-machine")
    path = tmp_path / "run.yaml"
    output = {"uri": "s3://models/runs/tiny", "endpoint": "http://127.0.0.1:8333", "region": "eu-west-1",
              "credentialsSecret": "s3-models"}  # a cluster's Secret: nothing to read here
    path.write_text(yaml.safe_dump(mutate(tiny_manifest, lambda s: s.update(output=output))))
    local = prepare(argparse.Namespace(manifest=str(path), runs_dir=str(tmp_path / "runs"), resume=False, fresh=False,
                                       rollout_url=["http://127.0.0.1:9"], rollout_python=None,
                                       rollout_restart_limit=None))
    (learner,) = [process.plan for name, process in local.processes.items() if "learner" in name]
    assert learner.env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:8333" and learner.env["AWS_REGION"] == "eu-west-1"
    assert "AWS_ACCESS_KEY_ID" not in learner.env  # the process inherits this machine's own


GUESS = {"name": "guess", "image": "registry.example/guess:1", "port": 8765,
         "command": ["python", "-m", "grpo_trainer.testing.guess_env"],
         "args": ["--port", "$(PORT)", "--x", "$$(PORT)"],
         "env": [{"name": "LEVEL", "value": "3"}]}


def test_environment_servers_run_their_command_here_on_free_ports_and_the_learner_is_told_where():
    spec = read_grporun(TINY).spec.model_copy(deep=True)
    spec.environments = [EnvironmentSpec.model_validate({**GUESS, "replicas": 2}),
                         EnvironmentSpec.model_validate({"name": "idle", "image": "i:1", "command": ["x"],
                                                         "replicas": 0})]
    plans = plan_processes("tiny", "default", spec, "/r.json", rollout_python="/rv", learner_python="/lv",
                           ports=LocalPorts([1], 2, 3, {"guess": [40001, 40002], "idle": []}))
    learner = next(plan for plan in plans if plan.role == "learner")
    servers = [plan for plan in plans if plan.role == "environment"]
    assert [server.name for server in servers] == ["tiny-env-guess-0", "tiny-env-guess-1"]
    first, second = servers
    # The pod's command and args, `python` as grporun's interpreter, $(PORT) as the kubelet expands it.
    assert first.argv == ["/lv", "-m", "grpo_trainer.testing.guess_env", "--port", "40001", "--x", "$(PORT)"]
    assert second.argv[4] == "40002" and second.url == "http://127.0.0.1:40002"
    assert first.env["PORT"] == "40001" and first.env["LEVEL"] == "3" and first.url == "http://127.0.0.1:40001"
    assert first.probe == LocalProbe("tcp")  # the pod's default: a TCP connect to its port
    # The learner gets every server's URL (its client pins each episode to one), and an environment without servers
    # names its spec's port.
    assert learner.env["GRPO_ENVIRONMENT_GUESS_URL"] == "http://127.0.0.1:40001,http://127.0.0.1:40002"
    assert learner.env["GRPO_ENVIRONMENT_IDLE_URL"] == "http://127.0.0.1:8000"


def test_an_environment_probe_runs_here_against_the_servers_own_port():
    http = EnvironmentSpec.model_validate({**GUESS, "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                                                                        "timeoutSeconds": 3}})
    assert local_probe(http, "spec.environments[0]") == LocalProbe("http", path="/health", timeout_s=3.0)
    command = EnvironmentSpec.model_validate({**GUESS, "readinessProbe": {"exec": {"command": ["test", "-e", "/x"]}}})
    assert local_probe(command, "spec.environments[0]") == LocalProbe("exec", command=("test", "-e", "/x"))


def test_command_references_expand_as_the_kubelet_expands_them():
    env = {"PORT": "41", "A": "a"}
    assert expand_references("--port=$(PORT)", env) == "--port=41"
    assert expand_references("$(A)$(A)-$(MISSING)-$$(A)-$$", env) == "aa-$(MISSING)-$(A)-$"
    assert expand_references("$(HOME)", env) == "$(HOME)"  # the container's variables only, not this machine's


def test_a_local_run_pins_its_hub_model_once_and_a_resumed_one_keeps_its_commit(tmp_path, tiny_manifest, hub,
                                                                                  monkeypatch):
    hub.add("pin/local", {"model_type": "qwen2"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(mutate(tiny_manifest, lambda s: s.update(model="pin/local"))))

    def started(*, resume: bool, fresh: bool):
        local = prepare(argparse.Namespace(manifest=str(path), runs_dir=str(tmp_path / "runs"), resume=resume,
                                           fresh=fresh, rollout_url=["http://127.0.0.1:9"], rollout_python=None,
                                           rollout_restart_limit=None))
        return local, load_run_config((local.run_dir / "run.json").read_text())

    first = commit_of("pin/local", "main")
    local, config = started(resume=False, fresh=False)
    assert config.model_revision == first and local.status["model"]["revision"] == first
    assert local.spec.model_revision is None  # the spec as asked; the run config and status hold the commit
    moved = hub.move("pin/local")
    assert started(resume=True, fresh=False)[1].model_revision == first  # goes on at the commit it started with
    assert started(resume=False, fresh=True)[1].model_revision == moved  # a new run: pinned anew
    monkeypatch.setenv("HF_ENDPOINT", f"http://{LOOPBACK}:{free_port()}")  # nothing listens there
    with pytest.raises(LocalError, match="pin/local: the hub cannot be reached .*the run does not start unpinned"):
        started(resume=False, fresh=True)
    path.write_text(yaml.safe_dump(mutate(tiny_manifest, lambda s: s.update(model="pin/local",
                                                                             modelRevision="unpinned"))))
    assert started(resume=False, fresh=True)[1].model_revision is None  # the opt-out asks no hub


def test_a_process_started_once_the_run_is_pinned_to_its_models_content_is_held_to_it(tmp_path):
    """The learner reports the content digest of the model it loaded (a path with an export manifest, or s3://) and
    the run is pinned to it: a rollout server or learner started after that (a scale-up, a restart) gets it, as a pod
    created then does, and refuses other content. An environment server loads no model."""
    spec = parse_spec(minimal_spec(model="/models/exported",
                                   environments=[{"name": "guess", "image": "g:1", "command": ["x"]}]))
    says = [sys.executable, "-c", f"import os; print(os.environ.get({MODEL_DIGEST_ENV!r}))"]
    processes = {name: LocalProcess(ProcessPlan(name, role, says, {}), tmp_path / f"{name}.log")
                 for name, role in (("tiny-rollout-0", "rollout"), ("tiny-learner-0", "learner"),
                                    ("tiny-env-guess-0", "environment"))}
    local = LocalRun("tiny", "default", spec, tmp_path, processes)
    port = LocalPort(local, lambda line: None)

    def started_with(status: dict) -> dict[str, str]:
        for process in processes.values():
            process.log_path.unlink(missing_ok=True)
        asyncio.run(port.create_children(None, status))
        for process in processes.values():
            process.popen.wait(timeout=30)
        local.stop(tuple(processes), recreate=True)
        return {name: process.log_path.read_text().strip() for name, process in processes.items()}

    assert set(started_with({}).values()) == {"None"}  # the first start: nothing reported yet
    digest = "d" * 64
    pinned = started_with({"model": {"name": "/models/exported", "requested": "digest", "revision": digest}})
    assert pinned == {"tiny-rollout-0": digest, "tiny-learner-0": digest, "tiny-env-guess-0": "None"}


def test_a_learner_killed_while_it_answers_progress_reads_as_no_answer():
    """The supervisor polls /progress while a learner may be killed: an answer cut short is no report, not a crash
    of `grporun local`."""
    cut_short = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1124\r\n\r\n{"
    with answering_once(cut_short) as url:
        assert read_progress_blocking(url) is None
