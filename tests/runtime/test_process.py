"""What every process sets up first: here, its log lines."""


def test_log_level_and_json_lines(capsys):
    import json
    import logging

    from epd.runtime.process import setup_logging

    try:
        setup_logging("decode", "warning", "json")
        logging.getLogger("epd.x").info("hidden")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("epd.x").exception("shown %d", 7)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1
        entry = json.loads(lines[0])
        assert entry["message"] == "shown 7" and entry["role"] == "decode"
        assert entry["level"] == "ERROR" and "ValueError: boom" in entry["exception"]
    finally:
        logging.getLogger().handlers.clear()
        logging.getLogger().setLevel(logging.WARNING)
