"""Chat records tokenized as transformers' ``apply_chat_template`` does: records read
(:mod:`.records`), rendered by the model's chat template (:mod:`.template`), encoded with a loss
mask (:mod:`.encoder`) in batches or worker processes (:mod:`.batches`) and written as shards
(:mod:`.corpus`)."""
