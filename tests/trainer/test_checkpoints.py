"""Which checkpoint a restarted learner resumes from."""


def test_resume_skips_a_checkpoint_interrupted_while_saving(tmp_path):
    from grpo_trainer.trainer import PROGRESS_STATE_FILE, newest_checkpoint

    assert newest_checkpoint(str(tmp_path / "missing")) is None
    for step, complete in ((2, True), (10, True), (12, False)):
        checkpoint = tmp_path / f"checkpoint-{step}"
        checkpoint.mkdir()
        if complete:
            (checkpoint / PROGRESS_STATE_FILE).write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    # checkpoint-12 is newest but was cut short; 10 beats 2 numerically, not by name
    assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")


def test_a_checkpoint_rewritten_in_place_is_not_resumed_from_while_torn(tmp_path, monkeypatch):
    # The end-of-run (or preemption) save at the step of a step save writes into the same checkpoint-N directory.
    # Killed meanwhile, the old marker vouched for a directory holding half of the new files.
    from types import SimpleNamespace

    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    from grpo_trainer.trainer import PROGRESS_STATE_FILE, GRPOLearner, newest_checkpoint

    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / PROGRESS_STATE_FILE).write_text("{}")

    def killed_while_saving(self, model, trial):
        (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt("SIGKILL stands in here")

    monkeypatch.setattr(AsyncGRPOTrainer, "_save_checkpoint", killed_while_saving)
    learner = object.__new__(GRPOLearner)  # only what _save_checkpoint reads
    learner.accelerator = SimpleNamespace(is_main_process=True)
    learner.state = SimpleNamespace(global_step=4)
    learner._get_output_dir = lambda trial: str(tmp_path)
    try:
        learner._save_checkpoint(None, None)
    except KeyboardInterrupt:
        pass
    assert newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
