"""The model in this process: llama.cpp's bindings, slot contexts, generation and its jobs, and
the chat template."""
