package shm

import "testing"

func TestSpaceQueueOrder(t *testing.T) {
	var sq SpaceQueues
	sq.init(2)
	a, b, c := make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{}, 1)
	if !sq.Join(1, a) {
		t.Fatal("the first writer of an empty queue is not its head")
	}
	if sq.Join(1, b) || sq.Join(1, c) {
		t.Fatal("a writer joining a queue with others in it became its head")
	}
	if sq.Waiters(0) != 0 || sq.Waiters(1) != 3 {
		t.Fatalf("waiters(0) %d, waiters(1) %d: want 0, 3", sq.Waiters(0), sq.Waiters(1))
	}
	sq.freed() // wakes the head alone
	if len(a) != 1 || len(b) != 0 || len(c) != 0 {
		t.Fatalf("after a free: wake-ups a %d, b %d, c %d; want only the head's", len(a), len(b), len(c))
	}
	<-a
	sq.Leave(1, c) // not the head: nobody is woken
	if len(a)+len(b) != 0 || !sq.IsHead(1, a) {
		t.Fatal("a writer leaving from the middle woke someone or changed the head")
	}
	sq.Leave(1, a) // the head: the next is woken and heads the queue
	if len(b) != 1 || !sq.IsHead(1, b) {
		t.Fatal("the head left and the next writer was not woken as the new head")
	}
	sq.Leave(1, b)
	if sq.Waiters(1) != 0 || sq.waiting.Load() != 0 {
		t.Fatalf("queue still has %d waiters, or counting %d, after all left", sq.Waiters(1), sq.waiting.Load())
	}
}
