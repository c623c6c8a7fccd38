"""`epd serve` set up as an operator would put it in front of users: an API key (kept out of
every child's command line), an allowed internal image host."""

import http.server
import io
import threading
from pathlib import Path

import openai
import pytest
from PIL import Image

from epd.local import LocalPipeline

from .stack import free_base, image_part, serve, text_part

KEY = "k-7f3a"


@pytest.fixture(scope="module")
def locked_stack(tiny_checkpoint, tmp_path_factory):
    config = tmp_path_factory.mktemp("auth") / "epd.yaml"
    config.write_text(f"prefill:\n  api_key: {KEY}\n")
    base = free_base()
    flags = ("--allowed-media-domains", "127.0.0.1")
    stack = serve(tiny_checkpoint, base, "--config", str(config), *flags)
    yield stack, base
    assert stack.stop() == 0, stack.output


@pytest.fixture(scope="module")
def client(locked_stack):
    _, base = locked_stack
    return openai.OpenAI(base_url=f"http://127.0.0.1:{base + 20}/v1", api_key=KEY, max_retries=0)


def test_the_client_needs_the_key(locked_stack):
    _, base = locked_stack
    url = f"http://127.0.0.1:{base + 20}/v1"
    keyed = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    model = keyed.models.list().data[0].id
    reply = keyed.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert reply.usage.completion_tokens >= 1
    wrong = openai.OpenAI(base_url=url, api_key="k-7f3b", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()


def test_the_key_is_in_no_command_line(locked_stack):
    stack, _ = locked_stack
    lines = [line for line in stack.output.splitlines() if "ready (pid" in line]
    pids = [int(line.split("(pid ")[1].split(")")[0]) for line in lines]
    assert len(pids) == 3
    for pid in [stack.popen.pid, *pids]:
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.fixture(scope="module")
def image_server():
    png = io.BytesIO()
    Image.new("RGB", (300, 200), "purple").save(png, "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/purple.png"
            self.send_response(200 if found else 404)
            self.end_headers()
            if found:
                self.wfile.write(png.getvalue())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_allowed_internal_host_serves_images(client, tiny_checkpoint, image_server):
    local = LocalPipeline(tiny_checkpoint, allowed_media_domains=("127.0.0.1",))
    content = [image_part(f"{image_server}/purple.png"), text_part("Shape?")]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, **body)
    assert reply.choices[0].message.content == local.chat({"model": model, **body}).text
    with pytest.raises(openai.BadRequestError, match="HTTP 404"):
        missing = [image_part(f"{image_server}/nope.png")]
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": missing}])
    with pytest.raises(openai.BadRequestError, match="'localhost' is not in the allowed media"):
        other = [image_part(image_server.replace("127.0.0.1", "localhost") + "/purple.png")]
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": other}])
