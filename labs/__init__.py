"""minipar's teaching labs: in each, a student writes one mechanism and minipar grades it,
on its own, under MPI, and inside the real trainer with --verify. labs/README.md is the
teacher's guide; labs/framework.py says what a lab is."""
