"""Files: atomic writes and staged directories, Hugging Face checkpoint directories, safetensors
shards."""
