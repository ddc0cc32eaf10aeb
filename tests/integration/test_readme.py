"""The README's "Sampling from a replica" examples, run as printed against a real replica: its
`rollout-service serve` line (its ports made 0, the ones it bound read from its log), each grpcurl
call, and the Python block with the `openai` client. grpcurl itself is a Go binary no package registry
here serves, so its calls go through the same JSON mapping it uses (protobuf's, unknown fields refused)
on a plain gRPC channel."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory

from fp8rl.v1 import rollout_pb2  # noqa: F401  (registers fp8rl.v1's messages)
from tests.support import bound_address, child_process, wait_for_line

ROOT = Path(__file__).resolve().parents[2]
GRPC_PORT, HTTP_PORT = "50051", "8000"  # as printed; replaced by 0 (the service picks free ones)


def readme_blocks(section: str) -> dict[str, list[str]]:
    """The fenced blocks of the README's ``section``, by language."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for language, code in re.findall(r"```(\w+)\n(.*?)```", body, re.S):
        blocks.setdefault(language, []).append(code)
    return blocks


def shell_commands(block: str) -> list[list[str]]:
    """A shell block's commands, each split as the shell would: a line ends one unless a quote is still
    open (or a backslash continues it); comments dropped."""
    commands, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if words:
            commands.append(words)
        pending = ""
    assert not pending, f"unclosed quote in {block!r}"
    return commands


def grpcurl(argv: list[str], port: int) -> dict:
    """One ``grpcurl -plaintext [-d JSON] HOST:PORT SERVICE/METHOD`` call, answered as grpcurl prints it."""
    assert argv[:2] == ["grpcurl", "-plaintext"], argv
    rest = argv[2:]
    body = "{}"
    if rest[0] == "-d":
        body, rest = rest[1], rest[2:]
    address, method = rest
    assert address == f"127.0.0.1:{GRPC_PORT}", address
    service, name = method.split("/")
    descriptor = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    request_type = message_factory.GetMessageClass(descriptor.input_type)
    response_type = message_factory.GetMessageClass(descriptor.output_type)
    request = json_format.Parse(body, request_type())  # unknown or mistyped fields raise, as in grpcurl
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            f"/{service}/{name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        return json_format.MessageToDict(call(request, timeout=60))


def test_the_readme_sampling_examples_run_as_printed(tmp_path: Path) -> None:
    blocks = readme_blocks("Sampling from a replica")
    [shell], [python] = blocks["sh"], blocks["python"]
    serve, *calls = shell_commands(shell)
    assert serve[:2] == ["rollout-service", "serve"] and calls, shell
    ports = {GRPC_PORT: "0", HTTP_PORT: "0"}
    argv = [str(Path(sys.executable).parent / "rollout-service"), *(ports.get(a, a) for a in serve[1:])]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = tmp_path / "rollout.log"
    with child_process(argv, log, env) as proc:
        grpc_port = int(bound_address(proc, log).rsplit(":", 1)[1])
        http_port = wait_for_line(proc, log, r"OpenAI-compatible HTTP on 127.0.0.1:(\d+)\n").group(1)
        wait_for_line(proc, log, r"serving on")
        answers = [grpcurl(call, grpc_port) for call in calls]
        client = subprocess.run(
            [sys.executable, "-c", python.replace(f"127.0.0.1:{HTTP_PORT}", f"127.0.0.1:{http_port}")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    one, four, status = answers
    assert len(one["completions"]) == 1 and one["completions"][0]["tokenIds"]
    assert len(four["completions"]) == 4
    for completion in four["completions"]:
        ids = completion["tokenIds"]
        assert 0 < len(ids) <= 8 and len(completion["logprobs"]) == len(ids)
        assert int(completion["weightVersion"]) == -1  # a fresh replica: the checkpoint it loaded
    assert int(status.get("weightVersion", 0)) == -1, json.dumps(status)
    assert client.returncode == 0, client.stderr[-3000:]
    printed, logprobs = client.stdout.rstrip("\n").rsplit("\n", 1)  # (the message may hold newlines)
    assert re.search(r"\[\d+(, \d+)*\] -1$", printed), printed  # the message, its token ids, the version
    assert all(float(x) <= 0.0 for x in logprobs.strip("[]").split(", ")), logprobs
