"""Offline tokenizing (``theseus tokenize``): a corpus of text (:mod:`.text`) or of chat records
(:mod:`.chat`) streamed into the token shards that :mod:`theseus.data` trains from, through one
scaffold (:mod:`.output`), and the tokenizer folder a model, run or corpus keeps (:mod:`.folder`).
The package is named for the activity: ``theseus.tokenize`` is the function."""
