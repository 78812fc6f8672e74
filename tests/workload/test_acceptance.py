"""The acceptance profile `bench --spec-profile-out` writes and `sim --spec-acceptance-profile` reads."""

from __future__ import annotations

import json
import re

import pytest

from servelab.errors import InvalidArgument, NotFound
from servelab.workload.acceptance import AcceptanceProfile, RequestAcceptance, load_profile

PROFILE = AcceptanceProfile(
    num_drafts=200, num_draft_tokens=780, num_accepted_tokens=240, accepted_per_position=(160, 60, 20, 0), source="s"
)


def test_a_written_profile_loads_back_with_its_rates(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.write(path)
    data = json.loads(path.read_text())
    assert data["num_speculative_tokens"] == 4 and data["acceptance_rate"] == pytest.approx(240 / 780)
    assert data["acceptance_per_position"] == pytest.approx([0.8, 0.375, 1 / 3, 0.0])
    assert load_profile(path) == PROFILE
    # the rates are derived: a file without them (written by hand) loads the same
    del data["acceptance_rate"], data["acceptance_per_position"], data["source"]
    path.write_text(json.dumps(data))
    assert load_profile(path) == AcceptanceProfile(200, 780, 240, (160, 60, 20, 0))


def test_rates_with_a_position_nobody_reached():
    p = AcceptanceProfile(10, 30, 4, (4, 0, 0))
    assert p.acceptance_per_position == (0.4, 0.0, 0.0)
    assert p.tokens_per_step == pytest.approx(1.4)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_drafts": None}, "missing field 'num_drafts'"),
        ({"accepted_per_position": None}, "missing field 'accepted_per_position'"),
        ({"num_drafts": -1}, "num_drafts must be an integer >= 0, got -1"),
        ({"num_draft_tokens": 7.5}, "num_draft_tokens must be an integer >= 0, got 7.5"),
        ({"num_accepted_tokens": True}, "num_accepted_tokens must be an integer >= 0, got True"),
        ({"accepted_per_position": "160,60"}, "accepted_per_position must be a list of counts"),
        ({"accepted_per_position": [160, "60", 20, 0]}, "accepted_per_position[1] must be an integer >= 0"),
        ({"num_speculative_tokens": 3}, "num_speculative_tokens is 3 but accepted_per_position has 4 entries"),
        ({"num_drafts": 0}, "num_drafts is 0"),
        ({"num_draft_tokens": 801}, "num_draft_tokens (801) exceeds num_drafts x num_speculative_tokens (200 x 4)"),
        ({"num_draft_tokens": 200}, "num_accepted_tokens (240) exceeds num_draft_tokens (200)"),
        ({"num_accepted_tokens": 250}, "accepted_per_position sums to 240, not num_accepted_tokens (250)"),
        ({"accepted_per_position": [60, 160, 20, 0]}, "must not rise with the position"),
        ({"acceptance_rate": 0.5}, "acceptance_rate 0.5 is not num_accepted_tokens / num_draft_tokens"),
    ],
)
def test_a_bad_field_is_named_with_the_file(tmp_path, change, message):
    data = PROFILE.to_dict()
    for key, value in change.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(
        InvalidArgument, match=re.escape(f"acceptance profile {str(path)!r}: ") + ".*" + re.escape(message)
    ):
        load_profile(path)


def test_a_missing_or_unreadable_file(tmp_path):
    with pytest.raises(NotFound, match="no such file.*--spec-profile-out"):
        load_profile(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        load_profile(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("[1, 2]")
    with pytest.raises(InvalidArgument, match="expected a JSON object, got list"):
        load_profile(tmp_path / "y.json")


def test_the_decode_step_count_gives_the_draft_coverage_and_is_checked(tmp_path):
    covered = AcceptanceProfile(200, 780, 240, (160, 60, 20, 0), "s", num_decode_steps=250)
    assert covered.draft_coverage == pytest.approx(0.8) and PROFILE.draft_coverage == 1.0
    path = tmp_path / "p.json"
    covered.write(path)
    data = json.loads(path.read_text())
    assert data["num_decode_steps"] == 250 and data["draft_coverage"] == pytest.approx(0.8)
    assert load_profile(path) == covered
    assert "num_decode_steps" not in PROFILE.to_dict()  # a profile without it stays vLLM's fields
    data["num_decode_steps"] = 150  # fewer steps than verifications cannot be
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidArgument, match=r"num_decode_steps \(150\) is below num_drafts \(200\)"):
        load_profile(path)
    data["num_decode_steps"] = 2.5
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidArgument, match="num_decode_steps must be an integer >= 0, got 2.5"):
        load_profile(path)


@pytest.mark.parametrize(
    "record, message",
    [
        ("x", r"per_request\[1\] must be an object"),
        ({"num_drafts": 1, "num_draft_tokens": 4}, r"per_request\[1\]: missing field 'num_decode_steps'"),
        ({"num_decode_steps": 2, "num_drafts": 3, "num_draft_tokens": 4}, r"num_drafts \(3\) exceeds num_decode_steps"),
        ({"num_decode_steps": 5, "num_drafts": 2, "num_draft_tokens": 4, "accepted_per_position": [1, 2]}, "rise"),
        ({"num_decode_steps": 5, "num_drafts": 1, "num_draft_tokens": 9, "accepted_per_position": [1]}, "more draft"),
        ({"num_decode_steps": -1, "num_drafts": 0, "num_draft_tokens": 0}, r"num_decode_steps must be an integer"),
    ],
)
def test_per_request_counts_load_back_and_a_bad_one_is_named(tmp_path, record, message):
    one = RequestAcceptance(
        num_decode_steps=40, num_drafts=31, num_draft_tokens=120, accepted_per_position=(25, 20, 10, 5)
    )
    profile = AcceptanceProfile(200, 780, 240, (160, 60, 20, 0), "s", per_request=(one, RequestAcceptance(9, 0, 0, ())))
    path = tmp_path / "p.json"
    profile.write(path)
    data = json.loads(path.read_text())
    assert data["per_request"][0] == {"num_decode_steps": 40, "num_drafts": 31, "num_draft_tokens": 120,
                                      "accepted_per_position": [25, 20, 10, 5]}  # fmt: skip
    assert load_profile(path) == profile
    data["per_request"][1] = record
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidArgument, match=message):
        load_profile(path)
