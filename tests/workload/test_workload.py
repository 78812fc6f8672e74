import argparse
import json
import math

import numpy as np
import pytest

from servelab.errors import InvalidArgument, NotFound
from servelab.workload import (
    ArrivalProcess,
    LengthDist,
    RequestSpec,
    WorkloadSpec,
    add_workload_arguments,
    simulated_prompt,
    token_ids_for,
    workload_from_args,
)


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize(
    "text, kind, mean",
    [
        ("1024", "fixed", 1024),
        ("512-2048", "uniform", 1280),
        ("uniform:512,2048", "uniform", 1280),
        ("lognormal:1024,0.5", "lognormal", 1024),
    ],
)
def test_length_forms_parse_and_sample_the_asked_mean(text, kind, mean):
    dist = LengthDist.parse(text)
    assert dist.kind == kind
    values = dist.sample(rng(), 20000)
    assert values.min() >= 1
    assert abs(values.mean() - mean) / mean < 0.02
    if kind == "uniform":
        assert values.min() == 512 and values.max() == 2048


def test_lognormal_sigma_is_the_spread():
    narrow = LengthDist.parse("lognormal:1000,0.1").sample(rng(), 20000)
    wide = LengthDist.parse("lognormal:1000,1.0").sample(rng(), 20000)
    assert np.std(np.log(narrow)) == pytest.approx(0.1, rel=0.1)
    assert np.std(np.log(wide)) == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("bad", ["", "abc", "0", "10-5", "uniform:5", "lognormal:100,-1", "lognormal:0,0.5"])
def test_bad_lengths_name_the_input(bad):
    with pytest.raises(InvalidArgument, match="input length"):
        LengthDist.parse(bad, name="input length")


@pytest.mark.parametrize(
    "huge",
    [
        "1000000000000000000000000",
        "1-100000000000000000000",
        "uniform:1,100000000000000000000",
        "lognormal:1e308,1",
        "lognormal:inf,1",
    ],
)
def test_lengths_past_a_billion_tokens_are_refused_not_overflowed(huge):
    # before: OverflowError or numpy's ValueError from sampling, or 1-token prompts from an inf mean
    with pytest.raises(InvalidArgument, match="input length: .* at most 1,000,000,000 tokens"):
        LengthDist.parse(huge, name="input length")
    assert LengthDist.parse("1000000000").sample(np.random.default_rng(0), 1)[0] == 10**9


def test_poisson_gaps_have_the_rate_and_unit_cv():
    times = ArrivalProcess.create(rate=10.0).arrival_times_s(rng(), 50000)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


def test_gamma_burstiness_as_vllm_defines_it():
    # shape = burstiness, scale = 1/(rate*burstiness): mean 1/rate, CV = 1/sqrt(burstiness)
    proc = ArrivalProcess.create(rate=4.0, burstiness=0.25)
    assert proc.kind == "gamma"
    gaps = np.diff(proc.arrival_times_s(rng(), 100000))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.05)


def test_constant_and_infinite_rate_and_closed_loop():
    const = ArrivalProcess.create(rate=5.0, burstiness=math.inf)
    assert const.kind == "constant"
    assert np.allclose(np.diff(const.arrival_times_s(rng(), 10)), 0.2)
    assert ArrivalProcess.create(rate=math.inf).arrival_times_s(rng(), 3).tolist() == [0, 0, 0]
    closed = ArrivalProcess.create(rate=None, concurrency=8)
    assert closed.closed_loop and closed.arrival_times_s(rng(), 5) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rate=0),
        dict(rate=-1),
        dict(rate=1, burstiness=0),
        dict(rate=None, concurrency=0),
        dict(rate=None, concurrency=4, burstiness=0.5),  # burstiness shapes a rate's gaps: none to shape
    ],
)
def test_bad_arrivals_are_rejected(kwargs):
    with pytest.raises(InvalidArgument):
        ArrivalProcess.create(**kwargs)


def test_same_seed_same_workload_and_streams_are_independent():
    a = WorkloadSpec(200, rate=3.0, input_len="100-900", output_len="lognormal:200,0.7", seed=7).generate()
    b = WorkloadSpec(200, rate=3.0, input_len="100-900", output_len="lognormal:200,0.7", seed=7).generate()
    c = WorkloadSpec(200, rate=3.0, input_len="100-900", output_len="lognormal:200,0.7", seed=8).generate()
    assert a == b and a != c
    # Changing only the output lengths must not move the arrivals or the prompts.
    d = WorkloadSpec(200, rate=3.0, input_len="100-900", output_len="64", seed=7).generate()
    assert [r.arrival_s for r in a] == [r.arrival_s for r in d]
    assert [r.prompt_tokens for r in a] == [r.prompt_tokens for r in d]


def test_closed_loop_has_no_arrival_times():
    reqs = WorkloadSpec(10, concurrency=4).generate()
    assert all(r.arrival_s is None for r in reqs)
    assert [r.prompt_tokens for r in reqs] == [1024] * 10 and [r.output_tokens for r in reqs] == [256] * 10


def test_shared_prefix_tokens_are_shared_within_a_group_only():
    reqs = WorkloadSpec(40, rate=1.0, input_len="1000", shared_prefix_fraction=0.5, num_prefix_groups=2).generate()
    assert all(r.prefix_tokens == 500 for r in reqs)
    assert {r.prefix_group for r in reqs} == {0, 1}
    ids = [token_ids_for(r, 32000) for r in reqs]
    assert all(len(t) == 1000 for t in ids)
    first = {}
    for r, t in zip(reqs, ids):
        first.setdefault(r.prefix_group, t)
        assert t[:500] == first[r.prefix_group][:500]
    g0 = next(t for r, t in zip(reqs, ids) if r.prefix_group == 0)
    g1 = next(t for r, t in zip(reqs, ids) if r.prefix_group == 1)
    assert g0[:500] != g1[:500]
    # The unique parts differ between requests.
    assert len({tuple(t[500:]) for t in ids}) == len(ids)
    assert all(0 <= x < 32000 for t in ids for x in t)


def test_a_shared_prefix_is_a_fraction_of_the_mean_prompt_whatever_the_request_count():
    # of the distribution's mean, not the sample's: asking for more requests moves no prefix
    few = WorkloadSpec(5, rate=1.0, input_len="lognormal:1024,1.5", shared_prefix_fraction=0.5, seed=1).generate()
    many = WorkloadSpec(50, rate=1.0, input_len="lognormal:1024,1.5", shared_prefix_fraction=0.5, seed=1).generate()
    assert [r.prefix_tokens for r in few] == [r.prefix_tokens for r in many[:5]]
    assert all(r.prefix_tokens == min(512, r.prompt_tokens - 1) for r in many)


def test_a_traces_shared_prefix_is_a_fraction_of_its_mean_prompt(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"arrival_s": i, "prompt_tokens": n, "output_tokens": 4}) + "\n"
                            for i, n in enumerate((100, 300, 50))))  # fmt: skip
    reqs = WorkloadSpec(trace=str(path), shared_prefix_fraction=0.5).generate()
    assert [r.prefix_tokens for r in reqs] == [75, 75, 49]  # half of the mean 150, all but one token of 50


def test_a_trace_stamped_with_wall_clock_times_starts_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"arrival_s": 1.7e9 + t, "prompt_tokens": 8, "output_tokens": 4}) + "\n"
                            for t in (0.0, 0.25)))  # fmt: skip
    assert [r.arrival_s for r in WorkloadSpec(trace=str(path)).generate()] == [0.0, 0.25]


def test_a_dataset_with_a_shared_prefix_is_refused(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]))
    with pytest.raises(InvalidArgument, match="drop --shared-prefix"):
        WorkloadSpec(10, rate=1.0, dataset=str(path), shared_prefix_fraction=0.5)


def test_token_ids_reproducible_and_prefix_consistent_across_lengths():
    a = RequestSpec(0, 0.0, prompt_tokens=300, output_tokens=1, prefix_tokens=200, prefix_group=3)
    b = RequestSpec(1, 0.0, prompt_tokens=150, output_tokens=1, prefix_tokens=100, prefix_group=3)
    assert token_ids_for(a, 1000) == token_ids_for(a, 1000)
    assert token_ids_for(a, 1000)[:100] == token_ids_for(b, 1000)[:100]
    assert token_ids_for(a, 1000, seed=1) != token_ids_for(a, 1000)


def write_sharegpt(path, n=20):
    entries = []
    for i in range(n):
        entries.append(
            {
                "id": str(i),
                "conversations": [
                    {"from": "human", "value": " ".join(["word"] * (6 + 3 * i))},
                    {"from": "gpt", "value": " ".join(["answer"] * (30 + i))},
                ],
            }
        )
    entries.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    entries.append({"id": "one-turn", "conversations": [{"from": "human", "value": "only a question here"}]})
    path.write_text(json.dumps(entries))


def test_sharegpt_lengths_from_words_or_a_tokenizer(tmp_path):
    path = tmp_path / "sg.json"
    write_sharegpt(path)
    reqs = WorkloadSpec(20, rate=1.0, dataset=str(path)).generate()
    assert len(reqs) == 20
    # 4/3 tokens per word; the too-short and one-turn entries are dropped.
    prompts = sorted(r.prompt_tokens for r in reqs)
    assert prompts == sorted(round((6 + 3 * i) * 4 / 3) for i in range(20))
    assert all(r.prompt_text and r.prompt_text.startswith("word") for r in reqs)
    exact = WorkloadSpec(20, rate=1.0, dataset=str(path)).generate(tokenizer=lambda s: list(range(len(s.split()))))
    assert sorted(r.prompt_tokens for r in exact) == sorted(6 + 3 * i for i in range(20))
    # More requests than conversations: drawn again.
    assert len(WorkloadSpec(50, rate=1.0, dataset=str(path)).generate()) == 50
    # An explicit output length overrides the dataset's.
    assert {r.output_tokens for r in WorkloadSpec(5, rate=1.0, dataset=str(path), output_len="7").generate()} == {7}


def test_trace_gives_arrivals_and_lengths(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"arrival_s": 2.0, "prompt_tokens": 50, "output_tokens": 5},
        {"arrival_s": 0.5, "prompt_tokens": 70, "output_tokens": 9, "prefix_tokens": 10, "prefix_group": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = WorkloadSpec(trace=str(path)).generate()
    # times from the first arrival
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0.0, 70, 9), (1.5, 50, 5)]
    assert reqs[0].prefix_tokens == 10 and reqs[0].prefix_group == 2
    assert len(WorkloadSpec(num_requests=1, trace=str(path)).generate()) == 1
    assert all(r.arrival_s is None for r in WorkloadSpec(trace=str(path), concurrency=2).generate())


def test_a_traces_description_counts_its_requests_and_names_its_arrivals(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(json.dumps({"arrival_s": t, "prompt_tokens": 50, "output_tokens": 5}) + "\n" for t in (0.0, 1.0, 2.0))
    )
    # not 1000 requests "poisson at inf req/s": the trace's 3, sent at its own times
    assert WorkloadSpec(trace=str(path)).describe() == f"3 requests, trace {path}, at the trace's arrival times"
    assert WorkloadSpec(num_requests=20, trace=str(path)).describe().startswith("3 requests,")  # capped by the trace
    one = WorkloadSpec(num_requests=1, trace=str(path))
    assert len(one.generate()) == 1 and one.describe().startswith("1 request,")
    closed = WorkloadSpec(trace=str(path), concurrency=2)
    assert closed.describe() == f"3 requests, trace {path}, closed loop, concurrency 2"


def test_bad_files_get_clear_errors(tmp_path):
    with pytest.raises(NotFound, match="no such file"):
        WorkloadSpec(trace=str(tmp_path / "missing.jsonl")).generate()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 5}\n')
    with pytest.raises(InvalidArgument, match="line 1: missing field 'output_tokens'"):
        WorkloadSpec(trace=str(bad)).generate()
    with pytest.raises(InvalidArgument, match="drop --rate"):
        WorkloadSpec(trace=str(bad), rate=2.0)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt_tokens": 10.5}, "prompt_tokens must be an integer >= 1, got 10.5"),
        ({"prompt_tokens": True}, "prompt_tokens must be an integer >= 1, got True"),
        ({"output_tokens": "9"}, "output_tokens must be an integer >= 1, got '9'"),
        ({"output_tokens": 0}, "output_tokens must be an integer >= 1, got 0"),
        ({"prefix_tokens": 2.5}, "prefix_tokens must be an integer >= 0, got 2.5"),
        ({"prefix_group": False}, "prefix_group must be an integer, got False"),
        ({"arrival_s": "1.5"}, "arrival_s must be a number of seconds, got '1.5'"),
        ({"arrival_s": True}, "arrival_s must be a number of seconds, got True"),
        ({"prefix_group": -1}, "prefix_group must be >= 0, got -1"),
        ({"prompt": 123}, "prompt must be text, got int"),
        ({"prompt_tokens": 10**12}, "prompt_tokens and output_tokens must be at most 1,000,000,000"),
    ],
)
def test_trace_token_counts_must_be_integers(tmp_path, row, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"arrival_s": 0, "prompt_tokens": 50, "output_tokens": 5, **row}) + "\n")
    with pytest.raises(InvalidArgument, match=f"line 1: {message}"):
        WorkloadSpec(trace=str(path)).generate()


def test_a_binary_trace_file_gets_a_clear_error(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00\x01binary\n")
    with pytest.raises(InvalidArgument, match="binary.json.*not UTF-8"):
        WorkloadSpec(trace=str(path)).generate()


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    args = parser.parse_args(
        [
            "--rate",
            "5",
            "--burstiness",
            "0.5",
            "--num-requests",
            "30",
            "--input-len",
            "lognormal:800,0.3",
            "--output-len",
            "10-20",
            "--shared-prefix",
            "0.25",
            "--seed",
            "3",
        ]
    )
    spec = workload_from_args(args)
    assert spec.arrivals.kind == "gamma" and spec.num_requests == 30 and spec.seed == 3
    reqs = spec.generate()
    assert len(reqs) == 30 and all(10 <= r.output_tokens <= 20 for r in reqs)
    assert spec.to_dict()["input_len"] == "lognormal:800,0.3"
    with pytest.raises(InvalidArgument, match="--rate must be > 0"):
        workload_from_args(parser.parse_args(["--rate", "0"]))
    with pytest.raises(InvalidArgument, match="--input-len"):
        workload_from_args(parser.parse_args(["--input-len", "x"]))


def test_simulated_prompt_blocks_are_equal_exactly_when_the_real_tokens_make_them_equal():
    # The simulator's stand-in prompt must tell blocks apart as the prefix cache would with
    # token_ids_for's tokens: block i of two requests equal (same chained hash) iff equal here.
    from servelab.core.block_manager import BlockManager
    from servelab.core.sequence import SamplingParams, Sequence

    rng = __import__("random").Random(7)
    bs = 16
    specs = []
    for i in range(60):
        prompt = rng.choice([40, 100, 160, 161, 200, 300])
        prefix = min(prompt, rng.choice([0, 0, 48, 100, 150, 300]))
        specs.append(
            RequestSpec(
                i, 0.0, prompt_tokens=prompt, output_tokens=1, prefix_tokens=prefix, prefix_group=rng.randint(0, 2)
            )
        )
    bm = BlockManager(1, bs)
    real, stand_in = {}, {}
    for spec in specs:
        seq = Sequence(str(spec.index), token_ids_for(spec, 50000, seed=3), SamplingParams())
        bm._update_block_hashes(seq)
        ids, hashes = simulated_prompt(spec, bs, seed=3)
        assert len(ids) == spec.prompt_tokens and len(hashes) == spec.prompt_tokens // bs == len(seq.prefix.hashes)
        for i, (h_real, h_sim) in enumerate(zip(seq.prefix.hashes, hashes)):
            real[(spec.index, i)] = h_real
            stand_in[(spec.index, i)] = h_sim
    keys = list(real)
    same_real = {(a, b) for a in keys for b in keys if real[a] == real[b]}
    same_sim = {(a, b) for a in keys for b in keys if stand_in[a] == stand_in[b]}
    assert same_real == same_sim
    assert len(same_real) > len(keys)  # some blocks are shared, so the check has teeth
    # The stand-in ids tell a request's own tokens from every other request's and group's.
    tags = {
        spec.index: set(simulated_prompt(spec, bs)[0][spec.prefix_tokens :])
        for spec in specs
        if spec.prompt_tokens > spec.prefix_tokens
    }
    assert all(len(t) == 1 for t in tags.values()) and len({t.pop() for t in tags.values()}) == len(tags)
    assert simulated_prompt(specs[0], bs, seed=1)[1] != simulated_prompt(specs[0], bs, seed=2)[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # a float64 clock 1e16 s in: every latency printed 0.00
        (
            {"num_requests": 20, "rate": 1e-15},
            r"rate 1e-15 requests/s spreads 20 requests .* at least 2e-08 requests/s",
        ),
        ({"num_requests": 20, "concurrency": 4, "think_time_s": 1e14}, r"think time 1e\+14 s: .* at most 2e\+08 s"),
        ({"num_requests": 10_000_000, "rate": 1e9}, "num_requests must be at most 1,000,000"),  # grew to 12 GB
    ],
)
def test_a_workload_the_clock_or_memory_cannot_hold_is_refused(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        WorkloadSpec(**kwargs)
    WorkloadSpec(num_requests=20, rate=2.1e-8)  # just inside: about 1e9 s
