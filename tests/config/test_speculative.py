"""vLLM's --speculative-config, as epd reads it: its JSON, defaults and checks."""

import pytest

from epd.config.roles import DecodeConfig
from epd.config.speculative import SpeculativeConfig


def test_the_config_reads_vllms_json_and_its_defaults():
    assert SpeculativeConfig.from_json("") is None  # off unless configured
    given = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert SpeculativeConfig.from_json(given) == SpeculativeConfig("ngram", 4, 5, 5)
    one = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'
    assert SpeculativeConfig.from_json(one) == SpeculativeConfig("ngram", 3, 2, 2)
    capped = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}'
    config = SpeculativeConfig.from_json(capped)
    assert config == SpeculativeConfig("ngram", 3, 5, 5, 8)
    assert config.drafts_at(7) and not config.drafts_at(8)
    assert SpeculativeConfig("ngram", 3).drafts_at(10_000)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "drafts by ngram"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "≥ 1"),
        ('{"method": "ngram", "num_speculative_tokens": 65}', "≤ 64"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "≥ 1"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "≥ 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "does not take model"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "must be ≤",
        ),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ],
)
def test_a_config_epd_cannot_run_is_a_clear_error(text, problem):
    with pytest.raises(ValueError, match=problem):
        SpeculativeConfig.from_json(text)


def test_decode_refuses_a_bad_config_as_it_starts():
    with pytest.raises(ValueError, match="speculative_config=.*drafts by ngram"):
        DecodeConfig(
            model="m", speculative_config='{"method": "eagle", "num_speculative_tokens": 1}'
        )
    given = DecodeConfig(
        model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'
    )
    assert SpeculativeConfig.from_json(given.speculative_config) == SpeculativeConfig("ngram", 3)
