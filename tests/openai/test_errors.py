"""Errors under /v1 in OpenAI's shape and statuses, seen through the SDK's exception classes;
the native API keeps its own shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.openai.conftest import ALPACA, Server

Tenant = tuple[openai.OpenAI, httpx.Client]


def test_wrong_purpose_is_a_bad_request_naming_purpose(tenant: Tenant) -> None:
    sdk, native = tenant
    with pytest.raises(openai.BadRequestError) as e:
        sdk.files.create(file=("a.jsonl", ALPACA), purpose="assistants")
    assert (e.value.param, e.value.code) == ("purpose", "invalid_purpose")
    assert "'assistants'" in e.value.message
    assert native.get("/datasets").json()["data"] == []  # nothing stored


def test_a_field_ftune_cannot_honour_is_refused_not_ignored(tenant: Tenant) -> None:
    sdk, native = tenant
    with pytest.raises(openai.BadRequestError) as e:
        sdk.files.create(
            file=("a.jsonl", ALPACA),
            purpose="fine-tune",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
    assert (e.value.param, e.value.code) == ("expires_after", "unsupported_parameter")
    assert native.get("/datasets").json()["data"] == []


def test_another_tenants_file_is_not_found(tenant: Tenant, server: Server) -> None:
    sdk, _ = tenant
    file_id = sdk.files.create(file=("a.jsonl", ALPACA), purpose="fine-tune").id
    other, other_native = server.tenant()
    with other, other_native:
        for call in (other.files.retrieve, other.files.content, other.files.delete):
            with pytest.raises(openai.NotFoundError) as e:
                call(file_id)
            assert e.value.code == "file_not_found"
        assert list(other.files.list()) == []
    assert sdk.files.retrieve(file_id).id == file_id  # untouched


def test_bad_key_is_an_authentication_error(server: Server) -> None:
    sdk = openai.OpenAI(api_key="ftk_wrong", base_url=f"{server.base}/v1", max_retries=0)
    with sdk, pytest.raises(openai.AuthenticationError) as e:
        sdk.files.list()
    assert e.value.status_code == 401
    assert e.value.type == "authentication_error"
    assert e.value.response.headers["www-authenticate"] == "Bearer"


def test_error_bodies_have_openai_shape(tenant: Tenant, server: Server) -> None:
    _, native = tenant
    r = native.get("/v1/files", params={"limit": 0})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": r.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": "limit",
            "code": "invalid_request",
        }
    }
    r = native.get("/v1/files", params={"after": "0" * 32})
    assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) == (
        400,
        "after",
        "invalid_cursor",
    )
    r = native.get("/v1/files/not-an-id")
    assert (r.status_code, set(r.json()["error"])) == (404, {"message", "type", "param", "code"})
    # A URL /v1 does not have, whatever the method, is OpenAI's 404 too.
    for method, path in (("GET", "/v1/nothing"), ("DELETE", "/v1/files"), ("POST", "/v1/files/x/y")):
        r = native.request(method, path)
        assert r.status_code == 404, (method, path)
        assert r.json()["error"]["code"] == "unknown_url"
        assert r.json()["error"]["message"] == f"Invalid URL ({method} {path})"
    r = httpx.get(f"{server.base}/v1/files")
    assert (r.status_code, r.json()["error"]["type"]) == (401, "authentication_error")


def test_the_native_api_keeps_its_error_shape(tenant: Tenant) -> None:
    _, native = tenant
    r = native.get("/datasets/0123456789abcdef")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"code", "message", "param", "details"}
    r = native.get("/datasets", params={"limit": 0})
    assert (r.status_code, set(r.json()["error"])) == (422, {"code", "message", "param", "details"})
