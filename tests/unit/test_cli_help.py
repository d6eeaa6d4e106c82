"""`llmopt --help` and each command's help print paragraphs the terminal wraps, not the source's line breaks."""

from typer.testing import CliRunner

from flows.cli import app, reflowed


def commands(typer_app, prefix=()):
    for command in typer_app.registered_commands:
        yield (*prefix, command.name or command.callback.__name__), command
    for group in typer_app.registered_groups:
        yield from commands(group.typer_instance, (*prefix, group.name))


def test_reflowing_joins_a_paragraphs_lines_and_keeps_paragraphs_apart():
    text = """First line of a paragraph
        that goes on here.

        A second paragraph."""
    assert reflowed(text) == "First line of a paragraph that goes on here.\n\nA second paragraph."


def test_every_commands_help_is_paragraphs_without_hard_line_breaks():
    seen = list(commands(app))
    assert len(seen) >= 10  # run, promote, serve, loadtest, services up/down/status, ...
    for path, command in seen:
        assert command.help, f"llmopt {' '.join(path)} has no help text"
        for paragraph in command.help.split("\n\n"):
            assert "\n" not in paragraph and paragraph == paragraph.strip(), (path, paragraph)


def test_the_top_level_help_lists_each_command_on_wrapped_lines():
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0
    # `promote`'s docstring breaks after "gate" in the source, which printed as a short line mid-sentence
    lines = [line.strip("│ ") for line in result.output.splitlines()]
    promote = next(index for index, line in enumerate(lines) if line.startswith("promote"))
    assert lines[promote + 1] != "champion/challenger gate", result.output
    assert "gate (both measured now" in " ".join(lines[promote : promote + 3]), result.output
