"""Slides read where archives keep them: HTTP(S) servers that answer range requests and S3.

:mod:`.address` tells a remote address from a path and shows it without credentials;
:mod:`.transport` fetches byte ranges (retries, bounded waits, errors that name the slide);
:mod:`.remote_file` is the positional-read file the TIFF reader reads through (a head block,
concurrent merged range requests, bounded caches, request counts); :mod:`.identity` is what a
batch's resume compares.
"""
