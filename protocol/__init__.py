"""What ringserve's processes agree on, importing nothing of ringserve's: the record layouts
of every ring and their protocol (records.py), the sampling parameters a request carries
(sampling_params.py), the bytes each token id stands for (vocab.py), and the
byte-bounded memo every cache keyed by client data uses (memo.py)."""
