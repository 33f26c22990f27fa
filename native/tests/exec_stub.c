/* A static program for dbxcr_held_chain's ancestors to exec (test_criu_incr): they are
 * stopped at its entry and given an image in place, so it never runs. */
int main(void)
{
	return 0;
}
