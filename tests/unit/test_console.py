import io

from tqdm import tqdm

from vlrft.console import say


def lines_as_shown(text: str) -> list[str]:
    """What a log reader (or a pipe read with universal newlines) sees: a carriage return starts a line."""
    return text.replace("\r", "\n").splitlines()


def test_a_message_during_the_progress_bar_gets_a_line_of_its_own():
    out = io.StringIO()
    bar = tqdm(total=4, desc="vlrft", file=out)
    bar.update(1)
    say("vlrft: rank 0 (trainer) stops: rank 1 (trainer) died", out)
    bar.update(1)
    bar.close()
    assert "vlrft: rank 0 (trainer) stops: rank 1 (trainer) died" in lines_as_shown(out.getvalue())
    assert lines_as_shown(out.getvalue())[-1].startswith("vlrft:  50%")  # the bar is drawn again after


def test_print_would_have_glued_it_to_the_bar():  # why say() exists
    out = io.StringIO()
    bar = tqdm(total=4, desc="vlrft", file=out)
    bar.update(1)
    print("vlrft: warning: x", file=out)
    bar.close()
    assert "vlrft: warning: x" not in lines_as_shown(out.getvalue())


def test_without_a_bar_it_is_a_plain_line(capsys):
    say("vlrft: warning: y")
    assert capsys.readouterr().out == "vlrft: warning: y\n"
