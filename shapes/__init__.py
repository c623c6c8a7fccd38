"""The shapes demo: a synthetic visual question-answering task, and training on it, that gives
epd's bundled checkpoint something real to see."""
