"""What ringserve's processes agree on, importing nothing of ringserve's: the record layouts
of every ring and their protocol (records.py), records as rows of bytes (record_bytes.py), the
payload blob a push carries (payloads.py), REQUEST records with their sampling settings
(request_records.py), the sampling parameters a request carries (sampling_params.py), the bytes
each token id stands for (vocab.py), and the byte-bounded memo every cache keyed by client data
uses (memo.py)."""
