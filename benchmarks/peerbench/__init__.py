"""peerbench: nanoserve beside transformers and llama.cpp, same prompts, same run."""
