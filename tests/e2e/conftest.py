import openai
import pytest

from epd.local import LocalPipeline

from .stack import free_base, serve


@pytest.fixture(scope="session")
def stack(tiny_checkpoint):
    """One `epd serve` (three OS processes) for the session's end-to-end tests."""
    base = free_base()
    process = serve(tiny_checkpoint, base)
    yield process, base
    assert process.stop() == 0, process.output


@pytest.fixture(scope="session")
def client(stack):
    _, base = stack
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{base + 20}/v1", api_key="unused", max_retries=0
    )


@pytest.fixture(scope="session")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def local(tiny_checkpoint):
    return LocalPipeline(tiny_checkpoint)
