"""Model aliases on a real ``sluice serve``: weights, stickiness, automatic rollback, the
admin API, the state file across a restart, and what the official SDK sees."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from scipy import stats

from sluice.rollout.assignment import in_canary
from tests.server import ServerProcess

VERSION = "x-sluice-model-version"
NUM_WEIGHTED_REQUESTS = 2000


def models_config(
    tmp_path: Path,
    *,
    mode: str,
    canary_weight: float,
    canary_faults: str = "",
    extra: str = "",
) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(
        f"""
[[alias]]
name = "assistant"
rollout = "{mode}"
{extra}

[[alias.version]]
name = "v1"
model = "words"
weight = {100 - canary_weight}
stable = true

[[alias.version]]
name = "v2"
model = "words"
weight = {canary_weight}
{canary_faults}
"""
    )
    return path


def chat(client: httpx.Client, user: str | None = None, **headers: str) -> httpx.Response:
    body: dict[str, object] = {
        "model": "assistant",
        "messages": [{"role": "user", "content": "hi"}],
    }
    if user is not None:
        body["user"] = user
    return client.post("/v1/chat/completions", json=body, headers=headers)


def rollout(client: httpx.Client) -> dict[str, object]:
    response = client.get("/v1/admin/rollouts")
    assert response.status_code == 200, response.text
    (described,) = response.json()["rollouts"]
    assert isinstance(described, dict)
    return described


@pytest.fixture
def manual_server(tmp_path: Path) -> Iterator[ServerProcess]:
    config = models_config(tmp_path, mode="manual", canary_weight=30)
    with ServerProcess("--no-model", "--models-config", str(config)) as server:
        yield server.wait_ready()


def test_weights_are_honoured_within_a_binomial_bound(manual_server: ServerProcess) -> None:
    keys = [f"user-{n}" for n in range(NUM_WEIGHTED_REQUESTS)]
    served: dict[str, str] = {}
    with httpx.Client(base_url=manual_server.base_url, timeout=30) as client:
        for key in keys:
            response = chat(client, key)
            assert response.status_code == 200, response.text
            served[key] = response.headers[VERSION]
    num_canary = sum(version == "v2" for version in served.values())
    low, high = stats.binom.interval(0.999, NUM_WEIGHTED_REQUESTS, 0.3)
    assert low <= num_canary <= high
    # And each key went exactly where its bucket says.
    rng = random.Random(0)
    expected = {key: "v2" if in_canary("assistant", key, 30, rng) else "v1" for key in keys}
    assert served == expected


def test_sticky_keys_never_flip_except_on_promotion_or_rollback(
    manual_server: ServerProcess,
) -> None:
    users = [f"u{n}" for n in range(150)]
    headers = [f"h{n}" for n in range(150)]

    def versions(client: httpx.Client) -> dict[str, str]:
        seen = {user: chat(client, user).headers[VERSION] for user in users}
        for key in headers:
            seen[key] = chat(client, None, **{"X-Sluice-Routing-Key": key}).headers[VERSION]
        return seen

    with httpx.Client(base_url=manual_server.base_url, timeout=30) as client:
        first = versions(client)
        assert versions(client) == first  # the same keys, the same versions
        assert set(first.values()) == {"v1", "v2"}
        promoted = client.post("/v1/admin/rollouts/assistant", json={"action": "promote"})
        assert promoted.status_code == 200, promoted.text
        assert promoted.json()["decision"]["to_weight"] == 50
        after = versions(client)
        # Promotion moves keys onto the canary only, never off it.
        assert all(after[key] == "v2" for key, version in first.items() if version == "v2")
        assert any(after[key] == "v2" for key, version in first.items() if version == "v1")
        assert versions(client) == after
        back = client.post("/v1/admin/rollouts/assistant", json={"action": "rollback"})
        assert back.status_code == 200, back.text
        assert set(versions(client).values()) == {"v1"}


def test_faulty_canary_is_rolled_back_and_its_users_next_requests_go_to_stable(
    tmp_path: Path,
) -> None:
    config = models_config(
        tmp_path,
        mode="auto",
        canary_weight=50,
        canary_faults="fault_error_rate = 0.5",
        extra="step_streams = 1000",
    )
    state = tmp_path / "rollouts.json"
    options = ("--no-model", "--models-config", str(config), "--rollout-state", str(state))
    canary_users: set[str] = set()
    with (
        ServerProcess(*options) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as client,
    ):
        server.wait_ready()
        for n in range(400):  # the analysis needs a few dozen canary streams
            user = f"user-{n}"
            response = chat(client, user)
            if response.headers[VERSION] == "v2":
                canary_users.add(user)
            else:
                assert response.status_code == 200, response.text
            if rollout(client)["state"] == "rolled_back":
                break
        described = rollout(client)
        assert described["state"] == "rolled_back"
        assert described["weights"] == {"v1": 100, "v2": 0}
        decision = described["last_decision"]
        assert isinstance(decision, dict)
        assert (decision["action"], decision["by"]) == ("roll_back", "auto")
        assert str(decision["reason"]).startswith("error: ")
        for user in sorted(canary_users):
            response = chat(client, user)
            assert response.status_code == 200, response.text
            assert response.headers[VERSION] == "v1"
        metrics = client.get("/metrics").text
        assert (
            'sluice_rollout_decisions_total{action="roll_back",alias="assistant",by="auto"} 1.0'
            in metrics
        )
        assert 'sluice_rollout_weight_percent{alias="assistant",model_version="v2"} 0.0' in metrics
        assert 'model="assistant",model_version="v2",reason="error"' in metrics
    assert json.loads(state.read_text())["rollouts"]["assistant"]["state"] == "rolled_back"
    # A restart reads the state file back: the canary stays rolled back.
    with (
        ServerProcess(*options) as server,
        httpx.Client(base_url=server.base_url, timeout=30) as client,
    ):
        server.wait_ready()
        assert rollout(client)["state"] == "rolled_back"
        assert {chat(client, user).headers[VERSION] for user in canary_users} == {"v1"}


def test_openai_sdk_sees_only_the_public_name(manual_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{manual_server.base_url}/v1", api_key="unused")
    listed = [model.id for model in client.models.list()]
    assert "assistant" in listed
    assert "v1" not in listed
    assert "v2" not in listed
    fingerprints = set()
    for n in range(20):
        stream = client.chat.completions.create(
            model="assistant",
            messages=[{"role": "user", "content": "one two three"}],
            stream=True,
            user=f"sdk-{n}",
        )
        chunks = list(stream)
        assert {chunk.model for chunk in chunks} == {"assistant"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
            "one two three"
        )
        fingerprints |= {chunk.system_fingerprint for chunk in chunks}
    assert fingerprints == {"v1", "v2"}
    whole = client.chat.completions.with_raw_response.create(
        model="assistant", messages=[{"role": "user", "content": "hi"}], user="sdk-whole"
    )
    completion = whole.parse()
    assert completion.model == "assistant"
    assert completion.system_fingerprint == whole.headers[VERSION]


def test_admin_actions_the_state_forbids_are_conflicts(manual_server: ServerProcess) -> None:
    with httpx.Client(base_url=manual_server.base_url, timeout=30) as client:
        start = client.post("/v1/admin/rollouts/assistant", json={"action": "start"})
        assert start.status_code == 409
        assert "rolled out by hand" in start.json()["error"]["message"]
        unknown = client.post("/v1/admin/rollouts/nope", json={"action": "promote"})
        assert unknown.status_code == 404
        bad = client.post("/v1/admin/rollouts/assistant", json={"action": 1})
        assert bad.status_code == 400


def test_admin_endpoints_need_an_admin_key_when_keys_are_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[key]]\ntenant = "ops"\nkey_env = "OPS_KEY"\nadmin = true\n'
        '[[key]]\ntenant = "team"\nkey_env = "TEAM_KEY"\n'
    )
    config = models_config(tmp_path, mode="manual", canary_weight=30)
    monkeypatch.setenv("OPS_KEY", "ops-secret")  # the server's environment
    monkeypatch.setenv("TEAM_KEY", "team-secret")
    server = ServerProcess("--no-model", "--models-config", str(config), "--auth-config", str(keys))
    with server, httpx.Client(base_url=server.base_url, timeout=30) as client:
        server.wait_ready()
        assert client.get("/v1/admin/rollouts").status_code == 401
        team = {"Authorization": "Bearer team-secret"}
        assert client.get("/v1/admin/rollouts", headers=team).status_code == 403
        ops = {"Authorization": "Bearer ops-secret"}
        assert client.get("/v1/admin/rollouts", headers=ops).status_code == 200
        # The tenant is the routing key of a caller that names no user.
        response = chat(client, None, **team)
        assert response.status_code == 200, response.text
        rng = random.Random(0)
        assert response.headers[VERSION] == (
            "v2" if in_canary("assistant", "team", 30, rng) else "v1"
        )
