"""LLM-as-judge against a tiny OpenAI-compatible server on 127.0.0.1."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncrl.rewards.judge import JudgeError, judge_reward, parse_score, render
from asyncrl.rewards.pool import RewardPool, RewardRequest, RewardSpec


class FakeJudge(BaseHTTPRequestHandler):
    """Replies by the graded answer: '42' scores 10, 'flaky' fails once, 'mute' has no score."""

    requests: list = []
    failures_left = {"flaky": 1}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeJudge.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        content = body["messages"][0]["content"]
        if "ANSWER=flaky" in content and FakeJudge.failures_left["flaky"] > 0:
            FakeJudge.failures_left["flaky"] -= 1
            return self._send(503, {"error": "busy"})
        if "ANSWER=bad-request" in content:
            return self._send(400, {"error": "no"})
        text = "I cannot tell." if "ANSWER=mute" in content else (
            "Correct.\nScore: 10" if "ANSWER=42" in content else "Wrong.\nScore: 3")
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": text}}]})

    def _send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


TEMPLATE = 'Q={prompt} ANSWER={response} REF={answer} {"format": "json braces stay"}'


def test_scores_are_parsed_and_scaled(base_url, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    kwargs = dict(base_url=base_url, model="judge-1", template=TEMPLATE, api_key_env="JUDGE_KEY")
    assert judge_reward("6*7?", "42", answer="42", **kwargs) == 1.0
    assert judge_reward("6*7?", "41", answer="42", **kwargs) == pytest.approx(0.3)
    last = FakeJudge.requests[-1]
    assert last["path"] == "/v1/chat/completions" and last["auth"] == "Bearer sk-test"
    assert last["body"]["model"] == "judge-1" and last["body"]["temperature"] == 0.0
    assert last["body"]["messages"][0]["content"] == 'Q=6*7? ANSWER=41 REF=42 {"format": "json braces stay"}'


def test_retries_server_errors_and_reports_unusable_replies(base_url):
    kwargs = dict(base_url=base_url, model="m", template=TEMPLATE, retries=2)
    assert judge_reward("q", "flaky", **kwargs) == pytest.approx(0.3)  # 503 once, then fine
    with pytest.raises(JudgeError, match="no score"):
        judge_reward("q", "mute", **kwargs)
    with pytest.raises(JudgeError, match="HTTP 400"):
        judge_reward("q", "bad-request", **kwargs)
    with pytest.raises(JudgeError, match="cannot reach"):
        judge_reward("q", "42", base_url="http://127.0.0.1:9", model="m", retries=0, timeout_s=2)


def test_judge_in_the_pool_records_failures(base_url):
    spec = RewardSpec("judge", "judge", kwargs={"base_url": base_url, "model": "m", "template": TEMPLATE})
    with RewardPool([spec], mode="thread", default_score=0.0) as pool:
        good, mute = pool.score([RewardRequest("q", "42"), RewardRequest("q", "mute")])
    assert good.total == 1.0 and mute.total == 0.0 and "no score" in mute.failed["judge"]


def test_render_and_parse_helpers():
    assert render("{a} {b} {unknown} {}", {"a": 1, "b": "x"}) == "1 x {unknown} {}"
    assert parse_score("Score: 2 ... final Score = 7.5") == 7.5
    assert parse_score("no number") is None
