from __future__ import annotations

from pathlib import Path

import pytest

from kbv.protocol import STANDARD, VERIFIED, ProtocolError, load_protocol, protocol_from_dict


def test_builtin_protocols_resolve_and_hash_stably() -> None:
    assert load_protocol("standard") is STANDARD
    assert load_protocol("verified") is VERIFIED
    assert STANDARD.sha256() == load_protocol("standard").sha256()
    assert STANDARD.sha256() != VERIFIED.sha256()


def test_standard_is_kernelbench_settings() -> None:
    c = STANDARD.correctness
    assert (c.mode, c.distributions, c.draws_per_distribution) == ("allclose", ("original",), 5)
    assert (c.atol_fp32, c.rtol_fp32, c.atol_half, c.rtol_half) == (1e-4, 1e-4, 1e-2, 1e-2)
    assert STANDARD.timing.baselines == ("eager_fp32",)


def test_toml_overrides_a_base(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(
        'name = "mine"\nversion = 3\nbase = "verified"\n'
        '[timing]\nbaselines = ["eager_fp32", "eager_tf32", "compile"]\n'
        '[integrity.severity]\nreference_operator = "fail"\n'
    )
    protocol = load_protocol(path)
    assert protocol.name == "mine" and protocol.version == 3
    assert protocol.timing.baselines == ("eager_fp32", "eager_tf32", "compile")
    assert protocol.integrity.severity_for("reference_operator", "warn") == "fail"
    assert protocol.correctness == VERIFIED.correctness
    # The stored form (a record's protocol.settings) resolves to the same protocol.
    again = protocol_from_dict({**protocol.to_dict(), "base": "verified"})
    assert again.sha256() == protocol.sha256()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "x"\n[timing]\nno_such = 1\n', "unknown setting 'no_such'"),
        ('name = "x"\nbase = "nope"\n', "base must be one of"),
        ("version = 1\n", "needs a name"),
        ('name = "x"\n[integrity.severity]\nfoo = "loud"\n', "fail, warn, info or off"),
        ("name = [", "not valid TOML"),
        (
            'name = "x"\n[integrity.severity]\ntimed_output_check = "warn"\n',
            "timed_output_check is now part of timed_call_outputs",
        ),
    ],
)
def test_bad_protocol_files_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ProtocolError, match=message):
        load_protocol(path)


def test_unknown_protocol_name() -> None:
    with pytest.raises(ProtocolError, match="unknown protocol 'fast'"):
        load_protocol("fast")


def test_a_stored_protocol_naming_a_folded_check_reads_with_its_successor() -> None:
    stored = {"name": "x", "integrity": {"severity": [["timed_output_check", "warn"]]}}
    protocol = protocol_from_dict(stored)
    assert protocol.integrity.severity_for("timed_call_outputs", "fail") == "warn"


def test_verified_draws_spiked_only_where_an_output_reduces_long() -> None:
    """Version 11 adds `spiked` for outputs that reduce 256 input elements or more; `standard` and
    its hash stay as they were (the new settings are written only when set)."""
    settings = VERIFIED.correctness
    assert VERIFIED.version == 11 and settings.distributions[-1] == "spiked"
    assert settings.long_reduction_distributions == ("spiked",) and settings.long_reduction_min == 256
    assert "long_reduction_min" not in STANDARD.to_dict()["correctness"]
    stored = protocol_from_dict({**VERIFIED.to_dict(), "base": "standard"})
    assert stored == VERIFIED  # a record's settings read back to the same protocol


#: ``standard``'s hash before ``timing.unseen_inputs`` existed: records and stores keep matching it.
STANDARD_SHA256 = "6d50060cdd3d71494173451c5cea328b10fd9c407ed2cf39c84055f600f06ceb"


def test_verified_times_unseen_inputs_and_standard_stays_kernelbenchs() -> None:
    """Only ``verified`` moves: version 4 gives every timed call an input set of its own, version 5
    judges three secretly picked calls a round; ``standard`` times its one set again and again, as
    KernelBench does, with the hash it had."""
    assert VERIFIED.version == 11 and VERIFIED.timing.unseen_inputs
    assert VERIFIED.timing.judged_calls == 3
    assert STANDARD.version == 1 and not STANDARD.timing.unseen_inputs
    assert STANDARD.timing.judged_calls == 0
    assert STANDARD.sha256() == STANDARD_SHA256
    assert "unseen_inputs" not in STANDARD.to_dict()["timing"]
    assert "judged_calls" not in STANDARD.to_dict()["timing"]
    assert "stop_when_futile" not in STANDARD.to_dict()["timing"] and VERIFIED.timing.stop_when_futile
    assert VERIFIED.to_dict()["timing"]["unseen_inputs"] is True
    assert VERIFIED.to_dict()["timing"]["judged_calls"] == 3
    # a stored record's settings read back to the same protocol, with or without the setting
    assert protocol_from_dict({**VERIFIED.to_dict(), "base": "verified"}) == VERIFIED
    assert protocol_from_dict({**STANDARD.to_dict(), "base": "standard"}) == STANDARD


def test_cuda_graphs_and_unseen_inputs_are_refused_together() -> None:
    with pytest.raises(ProtocolError, match="unseen inputs"):
        protocol_from_dict({"name": "graphs", "base": "verified", "timing": {"cuda_graph": True}})
    graphs = protocol_from_dict(
        {"name": "graphs", "base": "verified", "timing": {"cuda_graph": True, "unseen_inputs": False}}
    )
    assert graphs.timing.cuda_graph and not graphs.timing.unseen_inputs
