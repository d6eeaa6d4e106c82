"""`llmopt loadtest --prompt-words / --max-tokens / --prompt-start`: the request mix of one run in place of
`loadtest:`'s (the peer comparison's fixed mix without editing params.yaml), each option left unset keeping its
own, bad values one clear error naming the option."""

from __future__ import annotations

import pytest

from flows.cli.serving_commands import _with_mix
from tasks.errors import ConfigError
from tasks.params import Config


def test_the_options_replace_only_what_they_name():
    config = Config.model_validate({"variants": {"baseline": {}}})
    fixed = _with_mix(config, "96", "64", "anywhere").loadtest
    assert (fixed.prompt_words, fixed.max_tokens, fixed.prompt_start) == ([96, 96], [64, 64], "anywhere")
    ranged = _with_mix(config, "8,32", None, None).loadtest
    assert ranged.prompt_words == [8, 32] and ranged.max_tokens == config.loadtest.max_tokens
    assert _with_mix(config, None, None, None) is config
    assert config.loadtest.prompt_words == [8, 160]  # the loaded config itself untouched


@pytest.mark.parametrize(
    ("words", "tokens", "start", "message"),
    [
        ("64,8", None, None, "--prompt-words: a positive integer N or LOW,HIGH"),
        ("0", None, None, "--prompt-words"),
        ("1,2,3", None, None, "--prompt-words"),
        (None, "x", None, "--max-tokens: a positive integer N or LOW,HIGH"),
        (None, None, "middle", "--prompt-start: first or anywhere, got 'middle'"),
    ],
)
def test_bad_values_name_their_option(words, tokens, start, message):
    config = Config.model_validate({"variants": {"baseline": {}}})
    with pytest.raises(ConfigError, match=message):
        _with_mix(config, words, tokens, start)
