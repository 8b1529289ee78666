"""airlock's example Python-callable tools (policies/tools/word_count.toml)."""
