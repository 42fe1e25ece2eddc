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
