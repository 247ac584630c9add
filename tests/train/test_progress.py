"""attnres.train.progress: a bar on a terminal, plain log lines elsewhere."""

import io

from attnres.train.progress import StepProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_when_the_stream_is_not_a_terminal():
    out = io.StringIO()
    progress = StepProgress(total=40, initial=0, name="runs/x", stream=out)
    for step in range(1, 41):
        progress.update(step, 4.0 + 1 / step, 4980.4, val_loss=4.65 if step >= 25 else None, evaluated=step == 25)
    progress.close()
    lines = out.getvalue().splitlines()
    # every 40 // 20 = 2 steps, and the evaluation at step 25
    assert len(lines) == 21 and "\r" not in out.getvalue()
    assert lines[0] == "step 2/40  loss 4.5000  4,980 tok/s"
    assert lines[12] == "step 25/40  loss 4.0400  val 4.6500  4,980 tok/s"
    # the validation loss only on the line of the step that computed it, not repeated as if fresh
    assert lines[-1] == "step 40/40  loss 4.0250  4,980 tok/s"
    assert [line for line in lines if "val" in line] == [lines[12]]


def test_a_bar_named_by_the_run_on_a_terminal():
    out = Terminal()
    progress = StepProgress(total=5, initial=2, name="scheme=full/seed=1", stream=out)
    progress.update(3, 4.2, 1000.0)
    progress.close()
    text = out.getvalue()
    assert "scheme=full/seed=1" in text and "3/5" in text and "loss=4.200" in text and "step 3/5" not in text


def test_progress_bar_draws_only_on_a_terminal():
    quiet, loud = io.StringIO(), Terminal()
    assert list(progress_bar(range(3), total=3, desc="eval", stream=quiet)) == [0, 1, 2]
    assert quiet.getvalue() == ""
    list(progress_bar(range(3), total=3, desc="eval", stream=loud))
    assert "eval:" in loud.getvalue() and "/3 " in loud.getvalue()


def test_evaluation_shows_a_bar_over_its_batches(make, monkeypatch):
    import types

    import numpy as np

    from attnres.train.evaluation import evaluate

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    split = types.SimpleNamespace(tokens=np.arange(1, 200) % 50, bytes_per_token=1.0)
    quiet = evaluate(make("block"), split, batch_size=2, seq_len=8)
    assert terminal.getvalue() == ""
    shown = evaluate(make("block"), split, batch_size=2, seq_len=8, max_batches=5, progress=True)
    assert "eval:" in terminal.getvalue() and "/5 " in terminal.getvalue()
    assert quiet["val_loss"] > 0 and shown["val_loss"] > 0


def test_evaluation_off_a_terminal_writes_a_few_plain_lines(make, monkeypatch):
    """attnres eval in a log or a pipe (a kimi-tiny run took minutes) is not silent."""
    import types

    import numpy as np

    from attnres.train.evaluation import evaluate

    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    split = types.SimpleNamespace(tokens=np.arange(1, 400) % 50, bytes_per_token=1.0)
    result = evaluate(make("block"), split, batch_size=2, seq_len=8, max_batches=20, progress=True)
    lines = log.getvalue().splitlines()
    assert lines[0] == "eval: 0/20 batch" and lines[-1] == "eval: 20/20 batch" and 3 <= len(lines) <= 12
    assert "\r" not in log.getvalue() and result["val_batches"] == 20
