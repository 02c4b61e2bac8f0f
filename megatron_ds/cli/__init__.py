"""The bodies of the command lines in tools/: each tools/X.py (tools/checkpoint/X.py) only calls the
main(argv=None) of one module here, which tests call directly too. The quickstarts' steps live here
as well. The top floor: it may import any other, and nothing in the package imports it."""
