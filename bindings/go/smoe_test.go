package smoe

// The binding against the Python one: tests/test_bindings.py writes, from pysmoe on the tiny
// vault, a prompt and the logits after it and after each following greedy step; this feeds the
// same ids through Go and wants the same f32 bits. With SMOE_TEST_VAULT / SMOE_TEST_EXPECTED
// unset, that test is skipped.

import (
	"bufio"
	"errors"
	"math"
	"os"
	"strconv"
	"strings"
	"testing"
)

type step struct {
	id, next int32
	bits     []uint32
}

type expected struct {
	prompt      []int32
	chunk       uint32
	afterPrompt []uint32
	steps       []step
}

func parseInts(t *testing.T, words []string) []int32 {
	out := make([]int32, len(words))
	for i, w := range words {
		v, err := strconv.ParseInt(w, 10, 32)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = int32(v)
	}
	return out
}

func parseBits(t *testing.T, words []string) []uint32 {
	out := make([]uint32, len(words))
	for i, w := range words {
		v, err := strconv.ParseUint(w, 16, 32)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = uint32(v)
	}
	return out
}

// readExpected reads `prompt ID...`, `chunk N`, `logits HEX...` and `decode ID NEXT HEX...` lines.
func readExpected(t *testing.T, path string) expected {
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var e expected
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		w := strings.Fields(sc.Text())
		switch {
		case len(w) > 1 && w[0] == "prompt":
			e.prompt = parseInts(t, w[1:])
		case len(w) == 2 && w[0] == "chunk":
			e.chunk = uint32(parseInts(t, w[1:])[0])
		case len(w) > 1 && w[0] == "logits":
			e.afterPrompt = parseBits(t, w[1:])
		case len(w) > 3 && w[0] == "decode":
			ids := parseInts(t, w[1:3])
			e.steps = append(e.steps, step{ids[0], ids[1], parseBits(t, w[3:])})
		default:
			t.Fatalf("unexpected line in %s: %q", path, sc.Text())
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return e
}

func sameBits(t *testing.T, what string, got []float32, want []uint32) {
	if len(got) != len(want) {
		t.Fatalf("%s: %d logits, want %d", what, len(got), len(want))
	}
	for i := range got {
		if math.Float32bits(got[i]) != want[i] {
			t.Fatalf("%s: logit %d is %08x, Python had %08x", what, i, math.Float32bits(got[i]), want[i])
		}
	}
}

func TestLogitsMatchPython(t *testing.T) {
	dir, path := os.Getenv("SMOE_TEST_VAULT"), os.Getenv("SMOE_TEST_EXPECTED")
	if dir == "" || path == "" {
		t.Skip("SMOE_TEST_VAULT / SMOE_TEST_EXPECTED unset (tests/test_bindings.py sets them)")
	}
	want := readExpected(t, path)
	vault, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer vault.Close()
	params := vault.DefaultParams()
	params.Chunk = want.chunk
	session, err := vault.NewSession(params)
	if err != nil {
		t.Fatal(err)
	}
	defer session.Close()

	logits, err := session.Prefill(want.prompt)
	if err != nil {
		t.Fatal(err)
	}
	sameBits(t, "after the prompt", logits, want.afterPrompt)
	for i, st := range want.steps {
		logits, next, err := session.Step(st.id)
		if err != nil {
			t.Fatal(err)
		}
		sameBits(t, "decode step "+strconv.Itoa(i), logits, st.bits)
		if next != st.next {
			t.Fatalf("decode step %d: greedy id %d, Python had %d", i, next, st.next)
		}
	}
	if got := int(session.Position()); got != len(want.prompt)+len(want.steps) {
		t.Fatalf("position %d after %d ids", got, len(want.prompt)+len(want.steps))
	}
	t.Logf("go: %d logits vectors of %d floats bit-identical to Python's", 1+len(want.steps), len(want.afterPrompt))
}

func TestErrorCarriesStatusAndMessage(t *testing.T) {
	_, err := Open("/nonexistent/vault")
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("Open of a missing vault: %v", err)
	}
	if e.Status != -4 || !strings.Contains(e.Message, "/nonexistent/vault") {
		t.Fatalf("status %d, message %q", e.Status, e.Message)
	}
	if !strings.HasPrefix(e.Error(), "bad vault: ") {
		t.Fatalf("Error() = %q", e.Error())
	}
}
