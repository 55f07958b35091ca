"""The compiled stage functions: signatures, keep levels, row chunks, start-up measurements."""
