"""polyshard.data: corpora tokenized once into memory-mapped shards and read from any rank in constant memory."""
