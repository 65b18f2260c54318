"""Checkpoint formats, one room: the loader over them (`checkpoint`), ours (`ours`), Hugging Face folders (`hf`),
GGUF files (`gguf`, its container `gguf_file`), what they share (`build`, `folder`, `tokenizer`)."""
