"""servescope.loader: model sources (Hugging Face directories, GGUF files, random weights) turned into built models."""
