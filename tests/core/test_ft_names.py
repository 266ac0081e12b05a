from core.ft_names import FineTunedName, checkpoint_model, fine_tuned_model, parse

JOB = "0123456789abcdef"


def test_round_trip_of_a_model_and_a_checkpoint() -> None:
    name = fine_tuned_model("org/Llama-3.2-1B", "acme corp", "my:suffix", JOB)
    assert name == f"ft:org/Llama-3.2-1B:acme-corp:my-suffix:{JOB}"
    assert parse(name) == FineTunedName(JOB)
    assert parse(checkpoint_model(name, 120)) == FineTunedName(JOB, 120)


def test_no_suffix_keeps_the_empty_part() -> None:
    assert parse(fine_tuned_model("ftune-demo", "local", None, JOB)) == FineTunedName(JOB)


def test_malformed_names_are_none() -> None:
    for bad in ("ftune-demo", "ft:a:b:c", f"ft:a:b:c:{JOB}:step-3", "ft:a:b:c:../etc", f"ft:a:b:c:d:{JOB}:x"):
        assert parse(bad) is None, bad
