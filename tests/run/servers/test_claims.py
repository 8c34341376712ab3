"""Whose fault a disagreement with the config is (issue 38): decided only by the servers
heard from, naming which said what."""

from __future__ import annotations

from hsx_async.run.servers.claims import Claim, job_fault, server_fault

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def _says(server: str, value: str = "128") -> Claim:
    return Claim(server, "model.hidden_size", value, f"is 64, but {server} reports {value}")


def test_one_server_against_the_config_is_the_configs_fault_when_it_is_the_only_one() -> None:
    error = job_fault({A: _says(A)}, [A])
    assert error is not None and error.key == "model.hidden_size"
    assert str(error) == f"config key 'model.hidden_size': is 64, but {A} reports 128"


def test_a_server_not_heard_from_does_not_count() -> None:
    """The wrong server is up first; the right one has not answered yet: no verdict."""
    assert job_fault({A: _says(A)}, [A, B]) is None


def test_one_wrong_server_among_right_ones_is_its_own_fault() -> None:
    heard = {A: _says(A), B: None}
    assert job_fault(heard, [A, B]) is None
    why = server_fault(_says(A), heard)
    assert why.startswith("config key 'model.hidden_size' is 64, but http://a:1 reports 128")
    assert f"{B} agrees with the config" in why


def test_servers_that_disagree_among_themselves_are_not_the_configs_fault() -> None:
    heard = {A: _says(A, "128"), B: _says(B, "96")}
    assert job_fault(heard, [A, B]) is None
    assert f"{B} says 96" in server_fault(_says(A), heard)


def test_every_server_saying_the_same_is_the_configs_fault_naming_them_all() -> None:
    heard = {A: _says(A), B: _says(B), C: _says(C)}
    error = job_fault(heard, [A, B, C])
    assert error is not None and "\n" not in str(error)
    assert str(error).endswith(f"(every server says 128: {A}, {B}, {C})")


def test_no_server_is_no_verdict() -> None:
    assert job_fault({}, []) is None
